//! Pushed models served by name from the models directory: the layout, the temporary-name
//! convention, malformed models, and a tenant's own model changing its completions.

mod common;

use std::fs;

use common::*;
use serde_json::json;
use tenantvm_ngram::NgramModel;

/// A corpus sharing no words with the built-in model's.
const FABLE: &str = "Zebras juggle purple lanterns under moonlight. Purple lanterns glow softly.";

fn fable_model() -> NgramModel {
    NgramModel::train(FABLE, 3).unwrap()
}

fn complete(addr: std::net::SocketAddr, model: &str, prompt: &str) -> serde_json::Value {
    post(
        addr,
        "/v1/completions",
        &json!({"model": model, "prompt": prompt, "max_tokens": 3, "temperature": 0}),
    )
    .json()
}

#[test]
fn pushed_models_are_listed_and_selected_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let models = dir.path().to_path_buf();
    // A directory with model.json, and a single file.
    fs::create_dir(models.join("fables")).unwrap();
    write_model(&models.join("fables").join("model.json"), &fable_model());
    write_model(&models.join("fables-file"), &fable_model());
    let addr = start(test_config(), Some(models.clone()));

    let ids: Vec<String> = get(addr, "/v1/models")["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(ids, ["tenantvm-ngram", "fables", "fables-file"]);
    let listed = get(addr, "/v1/models");
    assert_eq!(listed["data"][1]["owned_by"], "tenant");

    // The tenant's model, trained on another corpus, changes the completion.
    let own = complete(addr, "fables", "zebras juggle");
    assert_eq!(own["choices"][0]["text"], " purple lanterns glow");
    assert_eq!(own["model"], "fables");
    let builtin = complete(addr, "tenantvm-ngram", "zebras juggle");
    assert_ne!(builtin["choices"][0]["text"], own["choices"][0]["text"]);
    // Without a model the built-in one answers (what the daemon sends today).
    let default = post(
        addr,
        "/v1/completions",
        &json!({"prompt": "zebras juggle", "max_tokens": 3, "temperature": 0}),
    )
    .json();
    assert_eq!(default["model"], "tenantvm-ngram");

    let serving = get(addr, "/v1/tenantvm/serving");
    assert_eq!(serving["models"][1]["source"], "pushed");
    assert_eq!(serving["models_dir"], models.to_str().unwrap());
}

#[test]
fn a_model_under_a_temporary_name_is_invisible_until_renamed() {
    let dir = tempfile::tempdir().unwrap();
    let models = dir.path().to_path_buf();
    let addr = start(test_config(), Some(models.clone()));
    // What `tenantvm model push` does: write .NAME.partial, sync, rename to NAME.
    fs::create_dir(models.join(".fables.partial")).unwrap();
    write_model(
        &models.join(".fables.partial").join("model.json"),
        &fable_model(),
    );
    assert_eq!(get(addr, "/v1/models")["data"].as_array().unwrap().len(), 1);
    let r = post(
        addr,
        "/v1/completions",
        &json!({"model": ".fables.partial", "prompt": "x"}),
    );
    assert_eq!(r.openai_error(404)["code"], "model_not_found");
    let r = post(
        addr,
        "/v1/completions",
        &json!({"model": "fables", "prompt": "x"}),
    );
    r.openai_error(404);

    fs::rename(models.join(".fables.partial"), models.join("fables")).unwrap();
    // The first request naming it finds it (an unknown name triggers a rescan).
    let v = complete(addr, "fables", "zebras juggle");
    assert_eq!(v["choices"][0]["text"], " purple lanterns glow");
}

#[test]
fn a_malformed_pushed_model_is_an_error_for_that_model_only() {
    let dir = tempfile::tempdir().unwrap();
    let models = dir.path().to_path_buf();
    fs::write(models.join("broken"), b"{\"order\": 3, \"vocab\": [").unwrap();
    let mut bad_ids = fable_model();
    bad_ids.contexts[0].next[0].0 = 1_000_000;
    write_model(&models.join("bad-ids"), &bad_ids);
    fs::create_dir(models.join("no-file")).unwrap();
    write_model(&models.join("fables"), &fable_model());
    let addr = start(test_config(), Some(models.clone()));

    for (name, words) in [
        ("broken", "not an n-gram model file"),
        ("bad-ids", "token id outside the vocabulary"),
        ("no-file", "without model.json"),
    ] {
        let e = post(
            addr,
            "/v1/completions",
            &json!({"model": name, "prompt": "x"}),
        )
        .openai_error(400);
        assert_eq!(e["code"], "model_load_failed", "{e}");
        assert_eq!(e["param"], "model");
        let msg = e["message"].as_str().unwrap();
        assert!(msg.contains(name) && msg.contains(words), "{msg}");
    }
    let serving = get(addr, "/v1/tenantvm/serving");
    let errors = serving["model_errors"].as_array().unwrap();
    assert_eq!(errors.len(), 3, "{serving}");
    // The server is unharmed: the good pushed model and the built-in one still answer.
    assert_eq!(
        complete(addr, "fables", "zebras juggle")["choices"][0]["text"],
        " purple lanterns glow"
    );
    assert_eq!(get(addr, "/v1/models")["data"].as_array().unwrap().len(), 2);

    // Pushed again, fixed: served on the next scan.
    write_model(&models.join(".broken.partial"), &fable_model());
    fs::rename(models.join(".broken.partial"), models.join("broken")).unwrap();
    assert_eq!(get(addr, "/v1/models")["data"].as_array().unwrap().len(), 3);
    assert_eq!(
        complete(addr, "broken", "zebras juggle")["choices"][0]["text"],
        " purple lanterns glow"
    );
}
