//! Conditions, as Kubernetes writes them (`type`, `status`, `reason`, `message`, and when
//! the status last changed), set by one writer per condition type.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// One condition of a resource's status.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Condition {
    /// What it is about (`Placed`, `Ready`, ...).
    #[serde(rename = "type")]
    pub type_: String,
    /// `True`, `False` or `Unknown`.
    #[schemars(extend("enum" = ["True", "False", "Unknown"]))]
    pub status: String,
    /// Why, in one PascalCase word.
    pub reason: String,
    /// Why, in words.
    pub message: String,
    /// When `status` last changed (RFC 3339).
    pub last_transition_time: String,
}

/// Sets condition `type_` in `list`; the transition time moves only when the status does.
/// Returns whether anything changed.
pub fn set(
    list: &mut Vec<Condition>,
    type_: &str,
    status: bool,
    reason: &str,
    message: &str,
) -> bool {
    let status = if status { "True" } else { "False" };
    match list.iter_mut().find(|c| c.type_ == type_) {
        Some(c) if c.status == status && c.reason == reason && c.message == message => false,
        Some(c) => {
            if c.status != status {
                c.last_transition_time = now_rfc3339();
            }
            c.status = status.into();
            c.reason = reason.into();
            c.message = message.into();
            true
        }
        None => {
            list.push(Condition {
                type_: type_.into(),
                status: status.into(),
                reason: reason.into(),
                message: message.into(),
                last_transition_time: now_rfc3339(),
            });
            true
        }
    }
}

/// Whether condition `type_` is `True` in `list`.
pub fn is_true(list: &[Condition], type_: &str) -> bool {
    list.iter().any(|c| c.type_ == type_ && c.status == "True")
}

/// The condition `type_` of `list`, if set.
pub fn get<'a>(list: &'a [Condition], type_: &str) -> Option<&'a Condition> {
    list.iter().find(|c| c.type_ == type_)
}

/// Now, RFC 3339 UTC to the second.
pub fn now_rfc3339() -> String {
    k8s_openapi::jiff::Timestamp::now()
        .round(k8s_openapi::jiff::Unit::Second)
        .map(|t| t.to_string())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_condition_changes_only_when_something_in_it_does() {
        let mut list = Vec::new();
        assert!(set(&mut list, "Ready", false, "Creating", "on its way"));
        let first = list[0].last_transition_time.clone();
        assert!(!set(&mut list, "Ready", false, "Creating", "on its way"));
        assert!(set(&mut list, "Ready", false, "Creating", "nearly"));
        assert_eq!(list[0].last_transition_time, first);
        assert!(set(&mut list, "Ready", true, "Running", "up"));
        assert!(is_true(&list, "Ready"));
        assert!(!is_true(&list, "Placed"));
        assert_eq!(list.len(), 1);
    }
}
