//! Schema migrations, applied in order; `PRAGMA user_version` records how many ran.

/// Each entry moves the schema from version `i` to `i + 1`. Append only: never edit one
/// that has shipped.
pub const MIGRATIONS: &[&str] = &[
    // 1: the initial schema.
    r#"
CREATE TABLE tenants (
    id          INTEGER PRIMARY KEY,
    name        TEXT    NOT NULL,
    state       TEXT    NOT NULL,
    spec        TEXT    NOT NULL,
    op          TEXT,
    op_id       INTEGER,
    error       TEXT,
    created_ms  INTEGER NOT NULL,
    updated_ms  INTEGER NOT NULL
);
-- One live tenant per name; destroyed rows stay as a record.
CREATE UNIQUE INDEX tenants_live_name ON tenants(name) WHERE state != 'destroyed';

CREATE TABLE ops (
    id          INTEGER PRIMARY KEY,
    tenant_id   INTEGER NOT NULL REFERENCES tenants(id),
    op          TEXT    NOT NULL,
    started_ms  INTEGER NOT NULL,
    finished_ms INTEGER,
    outcome     TEXT
);

CREATE TABLE steps (
    id          INTEGER PRIMARY KEY,
    op_id       INTEGER NOT NULL REFERENCES ops(id),
    tenant_id   INTEGER NOT NULL REFERENCES tenants(id),
    step        TEXT    NOT NULL,
    status      TEXT    NOT NULL CHECK (status IN ('started', 'done', 'failed')),
    error       TEXT,
    started_ms  INTEGER NOT NULL,
    finished_ms INTEGER,
    UNIQUE (op_id, step)
);

-- Everything a tenant holds on the host. (kind, key) is unique across tenants, so a uid,
-- a cgroup or a file can never be held twice.
CREATE TABLE resources (
    id          INTEGER PRIMARY KEY,
    tenant_id   INTEGER NOT NULL REFERENCES tenants(id),
    kind        TEXT    NOT NULL CHECK (kind IN ('process', 'cgroup', 'file', 'uid')),
    key         TEXT    NOT NULL,
    detail      TEXT,
    created_ms  INTEGER NOT NULL,
    UNIQUE (kind, key)
);
CREATE INDEX resources_tenant ON resources(tenant_id);

-- The GPU ledger: one row per occupied slot of a GPU; the primary key makes two
-- reservations of the same slot impossible.
CREATE TABLE gpu_reservations (
    gpu         TEXT    NOT NULL,
    slot        INTEGER NOT NULL,
    tenant_id   INTEGER NOT NULL REFERENCES tenants(id),
    placement   TEXT    NOT NULL,
    created_ms  INTEGER NOT NULL,
    PRIMARY KEY (gpu, slot)
);
CREATE INDEX gpu_reservations_tenant ON gpu_reservations(tenant_id);

CREATE TABLE events (
    id          INTEGER PRIMARY KEY,
    tenant_id   INTEGER REFERENCES tenants(id),
    at_ms       INTEGER NOT NULL,
    kind        TEXT    NOT NULL,
    message     TEXT    NOT NULL
);
CREATE INDEX events_tenant ON events(tenant_id, id);

CREATE TABLE tokens (
    id          INTEGER PRIMARY KEY,
    sha256      TEXT    NOT NULL UNIQUE,
    role        TEXT    NOT NULL CHECK (role IN ('admin', 'tenant')),
    tenant_id   INTEGER REFERENCES tenants(id),
    created_ms  INTEGER NOT NULL,
    revoked_ms  INTEGER,
    CHECK ((role = 'admin') = (tenant_id IS NULL))
);
"#,
    // 2: departures (the receipt in progress) and the GPU quarantine.
    r#"
-- One departure per tenant row: its id and the receipt's step records so far, persisted after
-- every departure step so that a resumed destroy appends exactly one complete receipt.
CREATE TABLE departures (
    tenant_id    INTEGER PRIMARY KEY REFERENCES tenants(id),
    departure_id TEXT    NOT NULL UNIQUE,
    receipt      TEXT    NOT NULL,
    appended_ms  INTEGER
);

-- GPU slots whose scrub did not verify: never reserved again until a scrub verifies.
CREATE TABLE gpu_quarantine (
    gpu         TEXT    NOT NULL,
    slot        INTEGER NOT NULL,
    placement   TEXT    NOT NULL,
    reason      TEXT    NOT NULL,
    since_ms    INTEGER NOT NULL,
    PRIMARY KEY (gpu, slot)
);
"#,
    // 3: facts decided once at create and stored with the tenant. Rows from before it have
    // NULL here; the daemon decides theirs the first time it loads them (and stores it).
    r#"
ALTER TABLE tenants ADD COLUMN guest TEXT CHECK (guest IN ('agent', 'plain'));
"#,
    // 4 (front door): inference keys: API keys a tenant's clients use at the front door, good
    // for that tenant's inference only. Only the SHA-256 of a key is kept; `shown` is its
    // first characters, for `tenantvm key list`.
    r#"
CREATE TABLE inference_keys (
    id          INTEGER PRIMARY KEY,
    tenant_id   INTEGER NOT NULL REFERENCES tenants(id),
    sha256      TEXT    NOT NULL UNIQUE,
    shown       TEXT    NOT NULL,
    created_ms  INTEGER NOT NULL,
    revoked_ms  INTEGER
);
CREATE INDEX inference_keys_tenant ON inference_keys(tenant_id);
"#,
    // 5: a GPU tenant's device, decided at
    // create and kept until its placement is released: the VM's UUID, the route's record
    // (JSON: what the host did to hand the share over, written before the step that acts on
    // it) and the devices the VM gets (JSON).
    r#"
CREATE TABLE gpu_devices (
    tenant_id   INTEGER PRIMARY KEY REFERENCES tenants(id),
    vm_uuid     TEXT    NOT NULL,
    record      TEXT    NOT NULL,
    devices     TEXT
);
"#,
    // 6: the vsock context id (CID) of a tenant whose agent is reached over vhost-vsock
    // (QEMU on a host with /dev/vhost-vsock): unique among live tenants, kept across stop and
    // start, removed at departure.
    r#"
CREATE TABLE vsock_cids (
    tenant_id   INTEGER PRIMARY KEY REFERENCES tenants(id),
    cid         INTEGER NOT NULL UNIQUE CHECK (cid >= 3 AND cid < 4294967295),
    created_ms  INTEGER NOT NULL
);
"#,
    // A step with nothing to do for its tenant (a GPU step of a tenant without a GPU, a
    // departure step its receipt records as skipped) is `skipped`, not `done`: SQLite
    // changes a CHECK only by rebuilding the table.
    r#"
CREATE TABLE steps_new (
    id          INTEGER PRIMARY KEY,
    op_id       INTEGER NOT NULL REFERENCES ops(id),
    tenant_id   INTEGER NOT NULL REFERENCES tenants(id),
    step        TEXT    NOT NULL,
    status      TEXT    NOT NULL CHECK (status IN ('started', 'done', 'skipped', 'failed')),
    error       TEXT,
    started_ms  INTEGER NOT NULL,
    finished_ms INTEGER,
    UNIQUE (op_id, step)
);
INSERT INTO steps_new SELECT id, op_id, tenant_id, step, status, error, started_ms, finished_ms FROM steps;
DROP TABLE steps;
ALTER TABLE steps_new RENAME TO steps;
"#,
];
