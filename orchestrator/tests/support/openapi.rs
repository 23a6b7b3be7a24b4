//! A small checker of JSON bodies against docs/api/openapi.yaml: enough of JSON Schema for
//! this spec ($ref, type (also as a list), enum, properties, required,
//! additionalProperties: false, items, oneOf, minimum, maximum, maxLength). Patterns are
//! not checked. Used by the API unit tests and the end-to-end tests.

#![allow(dead_code)]

use serde_json::Value;

/// The parsed spec.
pub struct OpenApi {
    root: Value,
}

impl OpenApi {
    /// Loads docs/api/openapi.yaml of this repository.
    pub fn load() -> OpenApi {
        let path =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/api/openapi.yaml");
        let text = std::fs::read_to_string(&path).expect("read openapi.yaml");
        let root: Value = serde_yaml_ng::from_str(&text).expect("openapi.yaml parses");
        OpenApi { root }
    }

    /// Every operation the spec declares, as (upper-case method, path template), sorted.
    pub fn operations(&self) -> Vec<(String, String)> {
        let mut ops = Vec::new();
        if let Some(paths) = self.root.get("paths").and_then(Value::as_object) {
            for (template, item) in paths {
                for method in ["get", "put", "post", "delete", "patch", "head", "options"] {
                    if item.get(method).is_some() {
                        ops.push((method.to_uppercase(), template.clone()));
                    }
                }
            }
        }
        ops.sort();
        ops
    }

    /// Checks a response body against the schema the spec declares for `method` on the path
    /// template (e.g. `/v1/tenants/{name}`) with this status.
    pub fn check_response(
        &self,
        method: &str,
        template: &str,
        status: u16,
        body: &Value,
    ) -> Result<(), String> {
        let op = self
            .root
            .pointer(&format!(
                "/paths/{}/{}",
                escape(template),
                method.to_lowercase()
            ))
            .ok_or_else(|| format!("spec has no {method} {template}"))?;
        let mut resp = op
            .pointer(&format!("/responses/{status}"))
            .ok_or_else(|| format!("spec has no {status} response for {method} {template}"))?;
        if let Some(r) = resp.get("$ref").and_then(Value::as_str) {
            resp = self.resolve(r)?;
        }
        let schema = resp
            .pointer("/content/application~1json/schema")
            .ok_or_else(|| format!("{method} {template} {status} has no JSON schema"))?;
        self.validate(schema, body, "$")
    }

    /// Checks a value against a named component schema.
    pub fn check_schema(&self, name: &str, value: &Value) -> Result<(), String> {
        let schema = self.resolve(&format!("#/components/schemas/{name}"))?;
        self.validate(schema, value, "$")
    }

    fn resolve(&self, r: &str) -> Result<&Value, String> {
        let ptr = r
            .strip_prefix('#')
            .ok_or_else(|| format!("external $ref {r}"))?;
        self.root
            .pointer(ptr)
            .ok_or_else(|| format!("dangling $ref {r}"))
    }

    fn validate(&self, schema: &Value, v: &Value, at: &str) -> Result<(), String> {
        if let Some(r) = schema.get("$ref").and_then(Value::as_str) {
            return self.validate(self.resolve(r)?, v, at);
        }
        if let Some(alts) = schema.get("oneOf").and_then(Value::as_array) {
            let ok = alts
                .iter()
                .filter(|s| self.validate(s, v, at).is_ok())
                .count();
            if ok != 1 {
                return Err(format!(
                    "{at}: matches {ok} of the oneOf alternatives, not exactly 1: {v}"
                ));
            }
            return Ok(());
        }
        if let Some(t) = schema.get("type") {
            let types: Vec<&str> = match t {
                Value::String(s) => vec![s.as_str()],
                Value::Array(a) => a.iter().filter_map(Value::as_str).collect(),
                _ => return Err(format!("{at}: bad type in schema")),
            };
            if !types.iter().any(|t| type_matches(t, v)) {
                return Err(format!("{at}: expected {types:?}, got {v}"));
            }
        }
        if let Some(e) = schema.get("enum").and_then(Value::as_array) {
            if !e.contains(v) {
                return Err(format!("{at}: {v} is not one of {e:?}"));
            }
        }
        if let (Some(min), Some(n)) = (schema.get("minimum").and_then(Value::as_f64), v.as_f64()) {
            if n < min {
                return Err(format!("{at}: {n} < minimum {min}"));
            }
        }
        if let (Some(max), Some(n)) = (schema.get("maximum").and_then(Value::as_f64), v.as_f64()) {
            if n > max {
                return Err(format!("{at}: {n} > maximum {max}"));
            }
        }
        if let (Some(max), Some(s)) = (schema.get("maxLength").and_then(Value::as_u64), v.as_str())
        {
            if s.chars().count() as u64 > max {
                return Err(format!("{at}: longer than {max}"));
            }
        }
        if let Some(obj) = v.as_object() {
            let props = schema.get("properties").and_then(Value::as_object);
            if let Some(req) = schema.get("required").and_then(Value::as_array) {
                for r in req.iter().filter_map(Value::as_str) {
                    if !obj.contains_key(r) {
                        return Err(format!("{at}: missing required field {r:?}"));
                    }
                }
            }
            for (k, val) in obj {
                match props.and_then(|p| p.get(k)) {
                    Some(s) => self.validate(s, val, &format!("{at}.{k}"))?,
                    None if schema.get("additionalProperties") == Some(&Value::Bool(false)) => {
                        return Err(format!("{at}: field {k:?} is not in the spec"));
                    }
                    None => {}
                }
            }
        }
        if let (Some(items), Some(arr)) = (schema.get("items"), v.as_array()) {
            for (i, item) in arr.iter().enumerate() {
                self.validate(items, item, &format!("{at}[{i}]"))?;
            }
        }
        Ok(())
    }
}

fn type_matches(t: &str, v: &Value) -> bool {
    match t {
        "object" => v.is_object(),
        "array" => v.is_array(),
        "string" => v.is_string(),
        "integer" => v.is_i64() || v.is_u64(),
        "number" => v.is_number(),
        "boolean" => v.is_boolean(),
        "null" => v.is_null(),
        _ => false,
    }
}

fn escape(template: &str) -> String {
    template.replace('~', "~0").replace('/', "~1")
}
