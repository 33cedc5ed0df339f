//! Never-panic fuzzing of the GGUF parser (and the tokenizer and chat-template loaders that
//! read its metadata): random bytes, truncations and byte flips of a small valid file.

use super::*;
use proptest::prelude::*;
use std::io::Write;

/// A small valid file with a tokenizer, so mutations also reach the tokenizer loader.
fn fuzz_base() -> Vec<u8> {
    let mut w = GgufWriter::new();
    w.add("general.architecture", GgufValue::String("llama".into()));
    w.add("llama.block_count", GgufValue::U32(2));
    w.add("tokenizer.ggml.model", GgufValue::String("gpt2".into()));
    w.add("tokenizer.ggml.pre", GgufValue::String("smollm".into()));
    let table = metashard::tokenizer::pretok::byte_to_char_table();
    let mut toks: Vec<String> = table.iter().map(|c| c.to_string()).collect();
    toks.extend(["ab".to_string(), "<|s|>".to_string()]);
    let mut types = vec![1i32; toks.len()];
    *types.last_mut().unwrap() = 3;
    w.add(
        "tokenizer.ggml.tokens",
        GgufValue::Array(GgufArray::String(toks)),
    );
    w.add(
        "tokenizer.ggml.token_type",
        GgufValue::Array(GgufArray::I32(types)),
    );
    w.add(
        "tokenizer.ggml.merges",
        GgufValue::Array(GgufArray::String(vec!["a b".into()])),
    );
    w.add(
        "a.nested",
        GgufValue::Array(GgufArray::Array(vec![GgufArray::U16(vec![1, 2])])),
    );
    w.add_tensor("w", DType::Q8_0, &[32, 2], vec![3; 68])
        .unwrap();
    w.add_tensor("n", DType::F32, &[4], vec![0; 16]).unwrap();
    w.to_bytes()
}

/// Parses `bytes`; when that succeeds, touches everything a loader would.
fn exercise(bytes: Vec<u8>) {
    use metashard::tokenizer::{BpeTokenizer, ChatTemplate, Tokenizer};
    if let Ok(g) = GgufFile::from_bytes("fuzz.gguf", bytes) {
        for (_, v) in g.metadata() {
            let _ = v.describe();
        }
        for t in g.tensors() {
            let _ = g.tensor_data(t);
            let _ = g.raw_tensor_data(t);
        }
        let _ = g.get_u32("llama.block_count");
        if let Ok(tok) = BpeTokenizer::from_gguf(&g)
            && let Ok(ids) = tok.encode("ab <|s|> 12 ab", true)
        {
            let _ = tok.decode(&ids);
        }
        let _ = ChatTemplate::from_gguf(&g);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn fuzz_random_bytes_never_panic(tail in prop::collection::vec(any::<u8>(), 0..600), header in any::<bool>()) {
        let mut b = if header { b"GGUF\x03\0\0\0".to_vec() } else { Vec::new() };
        b.extend(tail);
        exercise(b);
    }

    #[test]
    fn fuzz_truncations_never_panic(frac in 0.0f64..1.0) {
        let base = fuzz_base();
        let cut = (base.len() as f64 * frac) as usize;
        exercise(base[..cut].to_vec());
    }

    #[test]
    fn fuzz_byte_flips_never_panic(flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8)) {
        let mut b = fuzz_base();
        for (i, v) in flips {
            let at = i.index(b.len());
            b[at] = v;
        }
        exercise(b);
    }
}

#[test]
fn fuzz_base_is_valid_and_loads_its_tokenizer() {
    use metashard::tokenizer::{BpeTokenizer, Tokenizer};
    let g = GgufFile::from_bytes("fuzz.gguf", fuzz_base()).unwrap();
    let tok = BpeTokenizer::from_gguf(&g).unwrap();
    let ids = tok.encode("ab<|s|>", false).unwrap();
    assert_eq!(ids, vec![256, 257]);
    let _ = std::io::stderr().flush();
}
