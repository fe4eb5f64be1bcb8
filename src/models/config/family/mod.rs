//! The model families, one file each: what sets a family apart from the Llama decoder they all configure — its
//! names, its `config.json` keys and defaults, its GGUF metadata and tensor names, how its checkpoints store
//! experts, and the switches the decoder, the loader, merging and the memory estimate read. Each family implements
//! [`Family`], whose defaults are Llama's, and is listed once in `FAMILIES`; a model's configuration holds its
//! family as an [`Architecture`].
//!
//! Adding a family is a file here (a unit struct implementing [`Family`]) and its line in `FAMILIES`.

mod experts;
mod gemma2;
mod gemma3;
mod gpt_oss;
mod interface;
mod llama;
mod mistral;
mod mixtral;
mod phi3;
mod qwen2;
mod qwen2_moe;
mod qwen3;
mod qwen3_moe;

use std::fmt;
use std::ops::Deref;

use super::layers::LayerAttention;

pub use interface::{Family, GgufExperts, HubExperts, WindowKeys};

/// Every supported family, in the order messages list them.
const FAMILIES: &[&dyn Family] = &[
    &llama::Llama,
    &mistral::Mistral,
    &qwen2::Qwen2,
    &qwen3::Qwen3,
    &gemma2::Gemma2,
    &gemma3::Gemma3,
    &phi3::Phi3,
    &mixtral::Mixtral,
    &qwen2_moe::Qwen2Moe,
    &qwen3_moe::Qwen3Moe,
    &gpt_oss::GptOss,
];

/// A model's family: a handle on its [`Family`], whose methods it dereferences to. Two are equal when their
/// `model_type`s are; `{:?}` prints the family's name, which checkpoints' fingerprints hash.
#[derive(Clone, Copy)]
pub struct Architecture(&'static dyn Family);

impl Deref for Architecture {
    type Target = dyn Family;

    fn deref(&self) -> &(dyn Family + 'static) {
        self.0
    }
}

impl fmt::Debug for Architecture {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl PartialEq for Architecture {
    fn eq(&self, other: &Self) -> bool {
        self.model_type() == other.model_type()
    }
}

impl Eq for Architecture {}

impl Architecture {
    /// The family of a `config.json`'s `model_type`.
    pub fn parse(model_type: &str) -> Option<Self> {
        FAMILIES
            .iter()
            .find(|f| f.model_type() == model_type)
            .map(|f| Architecture(*f))
    }

    /// The family of a GGUF file's `general.architecture`, `has_experts` when it has `expert_count`.
    pub fn from_gguf(name: &str, has_experts: bool) -> Option<Self> {
        let with_experts = FAMILIES
            .iter()
            .find(|f| has_experts && f.gguf_name_with_experts() == Some(name));
        with_experts
            .or_else(|| {
                FAMILIES
                    .iter()
                    .find(|f| f.model_type() == name || f.gguf_names().contains(&name))
            })
            .map(|f| Architecture(*f))
    }

    /// The layer types of a model whose file lists none: the family's rule over `layers` layers.
    pub fn default_layer_types(self, layers: usize, window: &WindowKeys) -> Vec<LayerAttention> {
        (0..layers)
            .map(|i| match self.slides_by_default(i, window) {
                true => LayerAttention::Sliding,
                false => LayerAttention::Full,
            })
            .collect()
    }
}

/// The supported `model_type` values, for error messages.
pub fn supported_model_types() -> String {
    let names: Vec<String> = FAMILIES
        .iter()
        .map(|f| match f.known_models() {
            Some(models) => format!("{} ({models})", f.model_type()),
            None => f.model_type().to_string(),
        })
        .collect();
    names.join(", ")
}

/// Why a `config.json` of `model_type` is refused before it is read, if a family refuses it.
pub(crate) fn refused_model_type(model_type: &str) -> Option<&'static str> {
    FAMILIES
        .iter()
        .find_map(|f| f.refused_model_type(model_type))
}

/// The GGUF names beyond the `model_type`s, for error messages ("gemma3, qwen2moe, qwen3moe in llama.cpp's names,
/// and Mixtral as \`llama\` with experts").
pub(crate) fn llama_cpp_names() -> String {
    let own: Vec<&str> = FAMILIES
        .iter()
        .flat_map(|f| f.gguf_names())
        .copied()
        .collect();
    let with_experts: Vec<String> = FAMILIES
        .iter()
        .filter_map(|f| {
            f.gguf_name_with_experts()
                .map(|name| format!("{f:?} as `{name}` with experts"))
        })
        .collect();
    format!(
        "{} in llama.cpp's names, and {}",
        own.join(", "),
        with_experts.join(", ")
    )
}

/// The GGUF names a mixture of experts loads from, for error messages ("llama (Mixtral), qwen2moe and qwen3moe").
pub(crate) fn gguf_expert_names() -> String {
    let mut names = Vec::new();
    for f in FAMILIES.iter().filter(|f| f.is_moe()) {
        if let Some(name) = f.gguf_name_with_experts() {
            names.push(format!("{name} ({f:?})"));
        }
        names.extend(f.gguf_names().iter().map(|n| n.to_string()));
    }
    match names.split_last() {
        Some((last, [])) => last.clone(),
        Some((last, rest)) => format!("{} and {last}", rest.join(", ")),
        None => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every family is found by its `model_type`, which no other family has; checkpoints hash its `Debug` name, so
    /// that stays the Rust name it had.
    #[test]
    fn families_are_found_by_their_names() {
        let debug: Vec<String> = FAMILIES
            .iter()
            .map(|f| format!("{:?}", Architecture::parse(f.model_type()).unwrap()))
            .collect();
        assert_eq!(
            debug,
            [
                "Llama", "Mistral", "Qwen2", "Qwen3", "Gemma2", "Gemma3", "Phi3", "Mixtral",
                "Qwen2Moe", "Qwen3Moe", "GptOss"
            ]
        );
        let gguf = |name, experts| Architecture::from_gguf(name, experts).map(|a| a.model_type());
        assert_eq!(gguf("llama", false), Some("llama"));
        assert_eq!(gguf("llama", true), Some("mixtral"));
        assert_eq!(gguf("qwen2", true), Some("qwen2"));
        assert_eq!(gguf("qwen3moe", false), Some("qwen3_moe"));
        assert_eq!(gguf("gemma3", false), Some("gemma3_text"));
        assert_eq!(gguf("gemma3_text", false), Some("gemma3_text"));
        assert_eq!(gguf("gpt2", false), None);
        assert_eq!(Architecture::parse("qwen2moe"), None);
        assert_eq!(Architecture::parse("gemma3"), None);
    }

    /// Only the mixtures of experts read experts, from `config.json` and from GGUF metadata alike.
    #[test]
    fn mixtures_of_experts_say_so_everywhere() {
        for f in FAMILIES {
            assert_eq!(f.gguf_experts().is_some(), f.is_moe(), "{f:?}");
            assert!(f.gguf_name_with_experts().is_none() || f.is_moe(), "{f:?}");
        }
    }

    #[test]
    fn messages_list_every_family() {
        assert_eq!(
            supported_model_types(),
            "llama (Llama 2/3/3.1/3.2, SmolLM2, TinyLlama), mistral, qwen2, qwen3, gemma2, gemma3_text, phi3, \
             mixtral, qwen2_moe, qwen3_moe, gpt_oss"
        );
        assert_eq!(
            llama_cpp_names(),
            "gemma3, qwen2moe, qwen3moe in llama.cpp's names, and Mixtral as `llama` with experts"
        );
        assert_eq!(
            gguf_expert_names(),
            "llama (Mixtral), qwen2moe and qwen3moe"
        );
    }
}
