//! A real API server (scripts/kube-apiserver.sh: kube-apiserver 1.20 built from Debian's
//! source package, over etcd) on loopback, with the tier's CRDs and RBAC applied.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Namespace, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::PostParams;
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::wait::{await_condition, conditions};
use kube::{Api, Client};
use serde::de::DeserializeOwned;

/// The repository's root.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn script() -> PathBuf {
    repo_root().join("scripts/kube-apiserver.sh")
}

/// Why the API server cannot run here, if it cannot.
pub fn skip_reason() -> Option<String> {
    let bin = repo_root().join(".cache/kube/bin/kube-apiserver");
    if !bin.is_file() {
        return Some(format!(
            "{} is not built: run scripts/kube-apiserver.sh build (scripts/test.sh does)",
            bin.display()
        ));
    }
    if Command::new("etcd").arg("--version").output().is_err() {
        return Some(
            "etcd is missing: scripts/kube-apiserver.sh build installs etcd-server".into(),
        );
    }
    None
}

/// The running API server and etcd; stopped when dropped.
pub struct Cluster {
    /// Certificates, tokens, kubeconfigs, logs, etcd's data.
    pub dir: tempfile::TempDir,
}

impl Cluster {
    /// Starts etcd and the API server (a few seconds).
    pub fn start() -> Cluster {
        let dir = tempfile::Builder::new()
            .prefix("tvmkube")
            .tempdir_in("/tmp")
            .unwrap();
        let out = Command::new(script())
            .arg("start")
            .arg(dir.path())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "scripts/kube-apiserver.sh start failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        Cluster { dir }
    }

    /// The kubeconfig of identity `who` (`admin`, `operator`, `node-a`, ...).
    pub fn kubeconfig(&self, who: &str) -> PathBuf {
        if who == "admin" {
            self.dir.path().join("kubeconfig")
        } else {
            self.dir.path().join(format!("kubeconfig-{who}"))
        }
    }

    /// A client as `who`.
    pub async fn client(&self, who: &str) -> Client {
        client_from(&self.kubeconfig(who)).await
    }

    /// A client with a bearer `token` (a service account's).
    pub async fn client_with_token(&self, token: &str) -> Client {
        let text = std::fs::read_to_string(self.kubeconfig("admin")).unwrap();
        let admin = std::fs::read_to_string(self.dir.path().join("token-admin")).unwrap();
        let path = self
            .dir
            .path()
            .join(format!("kubeconfig-sa-{}", token.len() % 1000));
        std::fs::write(&path, text.replace(admin.trim(), token)).unwrap();
        client_from(&path).await
    }

    /// Stops the API server only (etcd keeps the data).
    pub fn stop_apiserver(&self) {
        self.run("stop-apiserver");
    }

    /// Starts the API server again over the same etcd.
    pub fn start_apiserver(&self) {
        self.run("start-apiserver");
    }

    fn run(&self, what: &str) {
        let out = Command::new(script())
            .arg(what)
            .arg(self.dir.path())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{what}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Applies the CRDs (waiting until they are established) and the RBAC manifests.
    pub async fn install(&self, admin: &Client) {
        let crds: Api<CustomResourceDefinition> = Api::all(admin.clone());
        for crd in docs::<CustomResourceDefinition>(&tenantvm_kube::crd::crds_yaml()) {
            let name = crd.metadata.name.clone().unwrap();
            crds.create(&PostParams::default(), &crd).await.unwrap();
            let established =
                await_condition(crds.clone(), &name, conditions::is_crd_established());
            tokio::time::timeout(Duration::from_secs(30), established)
                .await
                .expect("the CRD is established within 30 s")
                .unwrap();
        }
        let rbac = std::fs::read_to_string(repo_root().join("orchestrator/kube/deploy/rbac.yaml"))
            .unwrap();
        for doc in serde_yaml_ng::Deserializer::from_str(&rbac) {
            let value: serde_json::Value = serde::Deserialize::deserialize(doc).unwrap();
            if value.is_null() {
                continue;
            }
            apply_value(admin, value).await;
        }
    }

    /// Makes namespace `ns` with a service account `app` whose group is bound to the
    /// tenantvm-client role there (as deploy/rbac.yaml says a client namespace does).
    pub async fn client_namespace(&self, admin: &Client, ns: &str) {
        apply_value(
            admin,
            serde_json::json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}),
        )
        .await;
        apply_value(
            admin,
            serde_json::json!({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "app", "namespace": ns}}),
        )
        .await;
        apply_value(
            admin,
            serde_json::json!({
                "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
                "metadata": {"name": "tenantvm-client", "namespace": ns},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "tenantvm-client"},
                "subjects": [{"kind": "Group", "apiGroup": "rbac.authorization.k8s.io", "name": format!("system:serviceaccounts:{ns}")}]
            }),
        )
        .await;
    }

    /// A token of service account `ns/app` (TokenRequest).
    pub async fn service_account_token(&self, admin: &Client, ns: &str) -> String {
        use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
        let sas: Api<ServiceAccount> = Api::namespaced(admin.clone(), ns);
        let req = TokenRequest {
            spec: TokenRequestSpec {
                audiences: vec!["https://kubernetes.default.svc".into()],
                expiration_seconds: Some(3600),
                ..Default::default()
            },
            ..Default::default()
        };
        sas.create_token_request("app", &PostParams::default(), &req)
            .await
            .unwrap()
            .status
            .unwrap()
            .token
    }

    /// The API server's log so far.
    pub fn apiserver_log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("apiserver.log")).unwrap_or_default()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = Command::new(script())
            .arg("stop")
            .arg(self.dir.path())
            .output();
    }
}

async fn client_from(path: &Path) -> Client {
    let kc = Kubeconfig::read_from(path).unwrap();
    let config = kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
        .await
        .unwrap();
    Client::try_from(config).unwrap()
}

fn docs<T: DeserializeOwned>(yaml: &str) -> Vec<T> {
    serde_yaml_ng::Deserializer::from_str(yaml)
        .filter_map(|d| {
            let v: serde_json::Value = serde::Deserialize::deserialize(d).unwrap();
            (!v.is_null()).then(|| serde_json::from_value(v).unwrap())
        })
        .collect()
}

async fn create<T>(api: Api<T>, value: serde_json::Value)
where
    T: kube::Resource + Clone + DeserializeOwned + serde::Serialize + std::fmt::Debug,
{
    let obj: T = serde_json::from_value(value).unwrap();
    match api.create(&PostParams::default(), &obj).await {
        Ok(_) => {}
        Err(kube::Error::Api(e)) if e.code == 409 => {}
        Err(e) => panic!("{e}"),
    }
}

/// Creates one manifest of the kinds deploy/rbac.yaml holds (an existing one is kept).
async fn apply_value(admin: &Client, value: serde_json::Value) {
    let kind = value["kind"].as_str().unwrap().to_string();
    let ns = value["metadata"]["namespace"].as_str().map(str::to_string);
    let c = admin.clone();
    let nsd = |ns: &Option<String>| ns.clone().unwrap_or_default();
    match kind.as_str() {
        "Namespace" => create(Api::<Namespace>::all(c), value).await,
        "ServiceAccount" => create(Api::<ServiceAccount>::namespaced(c, &nsd(&ns)), value).await,
        "ClusterRole" => create(Api::<ClusterRole>::all(c), value).await,
        "ClusterRoleBinding" => create(Api::<ClusterRoleBinding>::all(c), value).await,
        "Role" => create(Api::<Role>::namespaced(c, &nsd(&ns)), value).await,
        "RoleBinding" => create(Api::<RoleBinding>::namespaced(c, &nsd(&ns)), value).await,
        other => panic!("rbac.yaml holds a {other}, which the test does not apply"),
    }
}
