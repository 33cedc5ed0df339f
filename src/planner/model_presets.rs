//! Model presets kept as the `config.json` their Hugging Face repository publishes (read by
//! [`super::ModelShape::from_config`], so a preset and the downloaded file plan alike): the
//! mixtures of experts Mixtral-8x7B v0.1 and Qwen3-30B-A3B. Each names its repository and the
//! size of its checkpoint (`metadata.total_size` of its `model.safetensors.index.json`: the
//! bytes of every tensor, bf16), which `tests/planner.rs` holds the planned weights against.

/// A preset: its name, where its configuration comes from, the configuration, and the bytes of
/// its published weights.
pub struct ConfigPreset {
    pub name: &'static str,
    /// The repository and file the configuration is copied from.
    pub source: &'static str,
    pub config_json: &'static str,
    /// `metadata.total_size` of the repository's `model.safetensors.index.json`.
    pub checkpoint_bytes: u64,
}

/// mistralai/Mixtral-8x7B-v0.1, `config.json` (https://huggingface.co/mistralai/
/// Mixtral-8x7B-v0.1/blob/main/config.json): 32 layers of width 4096, 32 query and 8 KV
/// heads, 8 experts of width 14336 (`num_local_experts`, `intermediate_size`), 2 per token
/// (`num_experts_per_tok`), vocabulary 32000, untied, bf16. Checkpoint: `total_size`
/// 93,405,585,408 bytes, as public code copies it from the index (of Mixtral-8x7B-Instruct-v0.1,
/// whose tensors have this model's shapes), and 46,702,792,704 parameters counted from this
/// configuration, times 2 bytes.
pub const MIXTRAL_8X7B: ConfigPreset = ConfigPreset {
    name: "mixtral-8x7b",
    source: "huggingface.co/mistralai/Mixtral-8x7B-v0.1 config.json",
    config_json: r#"{
  "architectures": ["MixtralForCausalLM"],
  "attention_dropout": 0.0,
  "bos_token_id": 1,
  "eos_token_id": 2,
  "hidden_act": "silu",
  "hidden_size": 4096,
  "initializer_range": 0.02,
  "intermediate_size": 14336,
  "max_position_embeddings": 32768,
  "model_type": "mixtral",
  "num_attention_heads": 32,
  "num_experts_per_tok": 2,
  "num_hidden_layers": 32,
  "num_key_value_heads": 8,
  "num_local_experts": 8,
  "output_router_logits": false,
  "rms_norm_eps": 1e-05,
  "rope_theta": 1000000.0,
  "router_aux_loss_coef": 0.02,
  "sliding_window": null,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "use_cache": true,
  "vocab_size": 32000
}"#,
    checkpoint_bytes: 93_405_585_408,
};

/// Qwen/Qwen3-30B-A3B, `config.json` (https://huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/
/// config.json): 48 layers of width 2048, 32 query and 4 KV heads of 128 features
/// (`head_dim`), 128 experts of width 768 (`num_experts`, `moe_intermediate_size`), 8 per
/// token, normalized (`norm_topk_prob`), every layer with experts (`decoder_sparse_step` 1,
/// `mlp_only_layers` empty), vocabulary 151936, untied, bf16. Checkpoint: `total_size`
/// 61,064,245,248 bytes in 16 shards, as public notes on loading it quote the index, and
/// 30,532,122,624 parameters counted from this configuration, times 2 bytes.
pub const QWEN3_30B_A3B: ConfigPreset = ConfigPreset {
    name: "qwen3-30b-a3b",
    source: "huggingface.co/Qwen/Qwen3-30B-A3B config.json",
    config_json: r#"{
  "architectures": ["Qwen3MoeForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 151643,
  "decoder_sparse_step": 1,
  "eos_token_id": 151645,
  "head_dim": 128,
  "hidden_act": "silu",
  "hidden_size": 2048,
  "initializer_range": 0.02,
  "intermediate_size": 6144,
  "max_position_embeddings": 40960,
  "max_window_layers": 48,
  "mlp_only_layers": [],
  "model_type": "qwen3_moe",
  "moe_intermediate_size": 768,
  "norm_topk_prob": true,
  "num_attention_heads": 32,
  "num_experts": 128,
  "num_experts_per_tok": 8,
  "num_hidden_layers": 48,
  "num_key_value_heads": 4,
  "output_router_logits": false,
  "rms_norm_eps": 1e-06,
  "rope_scaling": null,
  "rope_theta": 1000000.0,
  "router_aux_loss_coef": 0.001,
  "sliding_window": null,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "use_cache": true,
  "use_sliding_window": false,
  "vocab_size": 151936
}"#,
    checkpoint_bytes: 61_064_245_248,
};

/// Every preset of this kind.
pub const CONFIG_PRESETS: &[&ConfigPreset] = &[&MIXTRAL_8X7B, &QWEN3_30B_A3B];

/// The preset called `name`.
pub fn config_preset(name: &str) -> Option<&'static ConfigPreset> {
    CONFIG_PRESETS.iter().copied().find(|p| p.name == name)
}
