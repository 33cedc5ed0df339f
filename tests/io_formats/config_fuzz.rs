//! Never-panic fuzzing of the JSON a user hands the planner and the loaders: a model's
//! `config.json` (decoder and BERT), a cluster profile and a plan file, mutated as values (a
//! key set to a huge, negative, fractional or zero number, a number JSON cannot hold such as
//! `1e999` or `NaN`, a string, an array, null, or removed) and as bytes (flips, truncations).
//! Each must give an error or a sane result: a shape within the bounds of `models::limits`, a
//! profile whose every prediction is a finite positive time, a plan of the model's layers.

use super::*;
use metashard::io::JsonConfig;
use metashard::models::bert::BertConfig;
use metashard::planner::evaluate::{Workload, evaluate};
use metashard::planner::report::split_fn;
use metashard::planner::{Cluster, ModelShape, Strategy as SplitStrategy, parse_plan};
use proptest::prelude::*;
use serde_json::json;

/// A value to put at a key: numbers at and beyond every bound, wrong types, and raw tokens
/// (`Err`) spliced into the text where JSON has no such value.
fn value() -> impl Strategy<Value = std::result::Result<Value, &'static str>> {
    prop_oneof![
        prop::sample::select(vec![
            json!(0),
            json!(1),
            json!(-1),
            json!(3),
            json!(1023),
            json!(1025),
            json!(1u64 << 31),
            json!(1u64 << 32),
            json!(1u64 << 63),
            json!(u64::MAX),
            json!(i64::MIN),
            json!(0.5),
            json!(-0.5),
            json!(1e-9),
            json!(-0.0),
            json!(1e-300),
            json!(1e308),
            json!(-1e308),
            json!("12"),
            json!(true),
            json!(null),
            json!([1, 2]),
            json!({"a": 1}),
        ])
        .prop_map(Ok),
        any::<i64>().prop_map(|v| Ok(json!(v))),
        any::<f64>().prop_map(|v| Ok(json!(v))),
        prop::sample::select(vec![
            "1e999",
            "-1e999",
            "NaN",
            "Infinity",
            "18446744073709551616",
            "1e-400",
        ])
        .prop_map(Err),
    ]
}

/// `base` with the value at `path` (keys and array indices; a path that does not exist in
/// `base` adds the key) set to `v`, or removed when `v` is None; a raw token stands in the text.
fn mutate(base: &Value, path: &[&str], v: Option<std::result::Result<Value, &str>>) -> String {
    const MARK: &str = "__raw_token__";
    let mut root = base.clone();
    let mut at = &mut root;
    for k in &path[..path.len() - 1] {
        // An index past the end grows the array with copies of its first element (more
        // devices of the same kind).
        if let (Ok(i), Some(a)) = (k.parse::<usize>(), at.as_array_mut())
            && !a.is_empty()
        {
            while a.len() <= i {
                a.push(a[0].clone());
            }
        }
        at = match k.parse::<usize>() {
            Ok(i) if at.is_array() && i < at.as_array().map_or(0, Vec::len) => &mut at[i],
            _ => &mut at[*k],
        };
    }
    let last = path[path.len() - 1];
    let mut raw = None;
    match (v, at) {
        (None, Value::Object(m)) => {
            m.remove(last);
        }
        (None, _) => {}
        (Some(v), at) => {
            let slot = match last.parse::<usize>() {
                Ok(i) if at.is_array() && i < at.as_array().map_or(0, Vec::len) => &mut at[i],
                _ => &mut at[last],
            };
            *slot = match v {
                Ok(v) => v,
                Err(token) => {
                    raw = Some(token);
                    Value::String(MARK.into())
                }
            };
        }
    }
    let text = root.to_string();
    match raw {
        Some(t) => text.replace(&format!("\"{MARK}\""), t),
        None => text,
    }
}

fn decoder_config() -> Value {
    json!({
        "model_type": "llama", "hidden_size": 576, "intermediate_size": 1536,
        "num_attention_heads": 9, "num_key_value_heads": 3, "num_hidden_layers": 30,
        "vocab_size": 49152, "max_position_embeddings": 8192, "torch_dtype": "bfloat16",
        "tie_word_embeddings": true, "rms_norm_eps": 1e-5, "rope_theta": 100000.0
    })
}

fn bert_config() -> Value {
    json!({
        "hidden_size": 384, "num_attention_heads": 12, "intermediate_size": 1536,
        "num_hidden_layers": 6, "vocab_size": 30522, "max_position_embeddings": 512,
        "type_vocab_size": 2, "layer_norm_eps": 1e-12, "hidden_act": "gelu"
    })
}

/// A parsed shape is within the bounds and sizes its weights without overflow.
fn sane_shape(s: &ModelShape) {
    s.check().unwrap();
    assert!((1..=1024).contains(&s.n_layer()));
    assert!(s.weight_bytes() > 0);
    assert_eq!(s.cfg.n_embd % s.cfg.n_head, 0);
}

/// Parses `text` as a config.json both ways; whatever parses is sane.
fn exercise_config(text: &str) {
    let Ok(c) = JsonConfig::parse("fuzz/config.json", text) else {
        return;
    };
    // An error names the file (and the key), or the family when it is not a decoder.
    let names = |e: metashard::Error| {
        let e = e.to_string();
        assert!(
            e.contains("fuzz/config.json") || e.contains("encoder"),
            "{e}"
        );
    };
    match ModelShape::from_config(&c) {
        Ok(s) => sane_shape(&s),
        Err(e) => names(e),
    }
    match BertConfig::from_config(&c) {
        Ok(b) => {
            b.validate().unwrap();
            assert!(!metashard::models::bert::weight_layouts(&b).is_empty());
        }
        Err(e) => names(e),
    }
}

/// The profile of `h100x8-nvswitch` as JSON.
fn profile() -> Value {
    serde_json::from_str(&Cluster::preset("h100x8-nvswitch").unwrap().to_json()).unwrap()
}

/// Paths of a profile's figures (and a few that are not there).
const PROFILE_PATHS: &[&[&str]] = &[
    &["devices", "0", "memory_bytes"],
    &["devices", "1", "mem_bw"],
    &["devices", "2", "step_overhead_s"],
    &["devices", "0", "node_overhead_s"],
    &["devices", "3", "gemv_bw", "bf16"],
    &["devices", "3", "gemv_bw", "q4-0"],
    &["devices", "4", "gemm_flops", "f32"],
    &["devices", "5", "name"],
    &["devices", "9", "name"],
    &["devices"],
    &["links", "devices_per_node"],
    &["links", "intra", "all_reduce", "bus_bw"],
    &["links", "intra", "all_gather", "alpha_s"],
    &["links", "intra", "all_gather", "alpha_s", "0"],
    &["links", "intra", "reduce_scatter"],
    &["links", "intra", "broadcast"],
    &["links", "inter"],
    &["name"],
];

/// Whatever profile parses predicts a finite positive time (or an error) for a small model.
fn exercise_profile(text: &str) {
    let c = match Cluster::from_json(Path::new("fuzz/cluster.json"), text) {
        Ok(c) => c,
        Err(e) => {
            assert!(e.to_string().contains("fuzz/cluster.json"), "{e}");
            return;
        }
    };
    c.validate().unwrap();
    let shape = ModelShape::preset("smollm2-135m").unwrap().with_layers(2);
    let w = Workload::parse("pp=8,tg=4,ctx=64").unwrap();
    let split = SplitStrategy::Megatron.split(2, shape.tied).unwrap();
    if let Ok(e) = evaluate(&shape, split_fn(&shape, &split), &c, &w) {
        assert!(e.total_s.is_finite() && e.total_s > 0.0, "{}", e.total_s);
        assert!(e.decode_tps().is_finite() && e.decode_tps() > 0.0);
    }
}

/// A plan file of `smollm2-135m` on the 8-device preset, as JSON (made once).
fn plan_file() -> &'static Value {
    static PLAN: std::sync::OnceLock<Value> = std::sync::OnceLock::new();
    PLAN.get_or_init(make_plan_file)
}

fn make_plan_file() -> Value {
    let shape = ModelShape::preset("smollm2-135m").unwrap();
    let c = Cluster::preset("h100x8-nvswitch").unwrap();
    let w = Workload::parse("pp=8,tg=4,ctx=64").unwrap();
    let mut split = SplitStrategy::Megatron
        .split(shape.n_layer(), shape.tied)
        .unwrap();
    split.ratios = Some(vec![1.0, 2.0, 1.0, 1.0, 1.0, 1.0, 1.0, 3.0]);
    let e = evaluate(&shape, split_fn(&shape, &split), &c, &w).unwrap();
    let plan = metashard::planner::Plan::fixed(&shape, &c, &w, "megatron", split, e).unwrap();
    serde_json::from_str(&plan.to_json()).unwrap()
}

const PLAN_PATHS: &[&[&str]] = &[
    &["split", "layers"],
    &["split", "layers", "0"],
    &["split", "layers", "0", "attention"],
    &["split", "ratios"],
    &["split", "ratios", "0"],
    &["split", "ratios", "7"],
    &["split", "output"],
    &["split", "sequence_parallel"],
    &["devices"],
    &["devices", "0"],
    &["model"],
];

fn exercise_plan(text: &str) {
    let split = match parse_plan(Path::new("fuzz/plan.json"), text, 30, 8) {
        Ok(s) => s,
        Err(e) => {
            assert!(e.to_string().contains("fuzz/plan.json"), "{e}");
            return;
        }
    };
    assert_eq!(split.layers.len(), 30);
    if let Some(r) = &split.ratios {
        assert_eq!(r.len(), 8);
        assert!(r.iter().all(|x| x.is_finite() && *x >= 0.0));
        assert!(r.iter().sum::<f64>().is_finite() && r.iter().sum::<f64>() > 0.0);
    }
}

/// Byte-level damage: `flips` (position fraction, byte) and a cut at `cut` of the length.
fn damaged(text: &str, flips: &[(f64, u8)], cut: f64) -> String {
    let mut b = text.as_bytes().to_vec();
    for &(at, byte) in flips {
        let i = ((b.len() as f64 * at) as usize).min(b.len() - 1);
        b[i] = byte;
    }
    b.truncate((b.len() as f64 * cut).ceil() as usize);
    String::from_utf8_lossy(&b).into_owned()
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 512, failure_persistence: None, ..ProptestConfig::default()
    })]

    #[test]
    fn fuzz_config_json_values_never_panic(
        keys in prop::collection::vec(
            (prop::sample::select(vec![
                "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "max_position_embeddings", "rms_norm_eps",
                "rope_theta", "torch_dtype", "tie_word_embeddings", "model_type",
                "type_vocab_size", "layer_norm_eps", "hidden_act", "position_embedding_type",
            ]), prop::option::weighted(0.85, value())),
            1..4,
        ),
        bert in any::<bool>(),
    ) {
        let mut v = if bert { bert_config() } else { decoder_config() };
        for (k, val) in keys {
            let text = mutate(&v, &[k], val);
            match serde_json::from_str::<Value>(&text) {
                Ok(parsed) => v = parsed,
                Err(_) => {
                    exercise_config(&text);
                    return Ok(());
                }
            }
        }
        exercise_config(&v.to_string());
    }

    #[test]
    fn fuzz_config_json_bytes_never_panic(
        flips in prop::collection::vec((0.0f64..1.0, any::<u8>()), 0..4),
        cut in 0.0f64..=1.0,
        bert in any::<bool>(),
    ) {
        let base = if bert { bert_config() } else { decoder_config() };
        exercise_config(&damaged(&base.to_string(), &flips, cut));
    }

    #[test]
    fn fuzz_profiles_never_panic(
        path in prop::sample::select(PROFILE_PATHS.to_vec()),
        val in prop::option::weighted(0.85, value()),
        flips in prop::collection::vec((0.0f64..1.0, any::<u8>()), 0..2),
    ) {
        let text = mutate(&profile(), path, val);
        exercise_profile(&text);
        if !flips.is_empty() {
            exercise_profile(&damaged(&text, &flips, 1.0));
        }
    }

    #[test]
    fn fuzz_plan_files_never_panic(
        path in prop::sample::select(PLAN_PATHS.to_vec()),
        val in prop::option::weighted(0.85, value()),
        cut in 0.5f64..=1.0,
    ) {
        let text = mutate(plan_file(), path, val);
        exercise_plan(&text);
        exercise_plan(&damaged(&text, &[], cut));
    }
}
