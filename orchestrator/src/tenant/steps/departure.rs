//! The departure's own steps: closing the tenant's inference route first, revoking its
//! tokens, and appending the receipt that the other steps' records make up to the signed
//! audit log last.

use std::time::Instant;

use crate::receipt::{now_rfc3339, Assurance, DepartureStep, StepRecord, StepResult};
use crate::tenant::admission::Admission;
use crate::tenant::context::{StepCtx, StepError, Tenant};
use crate::tenant::steps::Op;

/// route-off: begins the departure (its id is fixed from here on) and closes the tenant's
/// admission gate for good, then checks that a request is refused.
pub fn route_off(
    ctx: &StepCtx<'_>,
    t: &mut Tenant,
    _op: Op,
) -> Result<Option<StepRecord>, StepError> {
    let started = now_rfc3339();
    ctx.store.begin_departure(t.id, &t.name)?;
    // The daemon's inference route is the only way to a guest's server: closing the
    // tenant's admission gate refuses every later request.
    let key = Admission::key(t.id, &t.name);
    let in_flight = ctx.admission.close(&key);
    // Checked, not assumed: a request now is refused. (After a daemon restart the gate is
    // new, and the tenant's destroying state refuses requests instead.)
    let refused = ctx
        .admission
        .admit(&key, &t.name, &t.spec.quotas, Instant::now())
        .is_err();
    if !refused {
        return Err(StepError::failed("the inference route did not close"));
    }
    // The front door's inference keys go with the route; checked by reading back.
    let keys_revoked = ctx.store.revoke_tenant_inference_keys(t.id)?;
    if ctx.store.live_inference_keys(t.id)? != 0 {
        return Err(StepError::failed(
            "an inference key is still live after revocation",
        ));
    }
    let keys = format!("{keys_revoked} inference key(s) revoked, none left live");
    let rec = if t.has_agent() {
        StepRecord::new(
            DepartureStep::GatewayRouteOff,
            &format!(
                "inference route closed: later requests are refused; {in_flight} \
                 request(s) were in flight and end with the guest's shutdown; {keys}"
            ),
            StepResult::Ok,
            Assurance::Verified,
            started,
            now_rfc3339(),
        )
    } else {
        StepRecord::new(
            DepartureStep::GatewayRouteOff,
            &format!(
                "no inference server: the tenant runs no guest image, so it had no route; {keys}"
            ),
            StepResult::Skipped,
            Assurance::NotApplicable,
            started,
            now_rfc3339(),
        )
    };
    Ok(Some(rec))
}

/// revoke-tokens: the tenant's tokens stop working (a departed tenant's token still reads
/// its own receipt).
pub fn revoke_tokens(
    ctx: &StepCtx<'_>,
    t: &mut Tenant,
    _op: Op,
) -> Result<Option<StepRecord>, StepError> {
    ctx.store.revoke_tenant_tokens(t.id)?;
    Ok(None)
}

/// write-receipt: appends the departure's receipt to the signed audit log (idempotent per
/// departure id).
pub fn write_receipt(
    ctx: &StepCtx<'_>,
    t: &mut Tenant,
    _op: Op,
) -> Result<Option<StepRecord>, StepError> {
    let kit = ctx.kit()?;
    let receipt = ctx.store.begin_departure(t.id, &t.name)?;
    let entry = kit
        .log
        .append(&kit.signer, &receipt)
        .map_err(StepError::failed)?;
    ctx.store.departure_appended(t.id)?;
    ctx.store.add_event(
        Some(t.id),
        "departure",
        &format!(
            "receipt {} appended to the audit log as entry {}",
            receipt.departure_id, entry.seq
        ),
    )?;
    Ok(None)
}
