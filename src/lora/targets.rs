//! Which modules get adapters, and with which rank and alpha — PEFT's matching rules.
//!
//! - a list entry matches a module whose name equals it or ends with `.` + it;
//! - a string is a regular expression that must match the whole name (`re.fullmatch`);
//! - `"all-linear"` matches every linear layer except the output head;
//! - `rank_pattern` / `alpha_pattern` keys are regexes matched against the end of the name (`(.*\.)?key$`).

use regex::Regex;

use super::config::{LoraConfig, TargetModules, DEFAULT_LLAMA_TARGETS};
use crate::error::{Error, Result};

fn matches(targets: &TargetModules, name: &str) -> Result<bool> {
    Ok(match targets {
        TargetModules::AllLinear => true,
        TargetModules::List(list) => list
            .iter()
            .any(|t| name == t || name.ends_with(&format!(".{t}"))),
        TargetModules::Regex(r) => Regex::new(&format!("^(?:{r})$"))
            .map_err(|e| Error::InvalidInput(format!("target regex {r:?} is invalid: {e}")))?
            .is_match(name),
    })
}

/// The PEFT parameter a projection of a mixture-of-experts layer stands for, `None` for the other projections
/// (`nn.Linear` modules in transformers). transformers 5 holds a sparse layer's router as a module with one
/// `weight` (`mlp.gate` → `mlp.gate.weight`; gpt-oss's `mlp.router`) and its experts as 3-D parameters of one module (`mlp.experts.{e}.
/// gate_up_proj` → `mlp.experts.gate_up_proj`), which PEFT adapts through `target_parameters`, not
/// `target_modules`.
pub fn parameter_of(name: &str) -> Option<String> {
    for router in [".mlp.gate", ".mlp.router"] {
        if name.ends_with(router) {
            return Some(format!("{name}.weight"));
        }
    }
    let (layer, rest) = name.split_once(".mlp.experts.")?;
    let (expert, projection) = rest.split_once('.')?;
    expert
        .parse::<usize>()
        .ok()
        .map(|_| format!("{layer}.mlp.experts.{projection}"))
}

/// True if the linear module `name` (e.g. `model.layers.0.self_attn.q_proj`) gets an adapter. The output head
/// (`lm_head`) is never targeted by `"all-linear"`. A mixture's router and experts (see [`parameter_of`]) are
/// targeted by `target_parameters` alone, matched as PEFT matches them: the parameter's name equals an entry or
/// ends with `.` + it.
pub fn is_target(config: &LoraConfig, name: &str) -> Result<bool> {
    if let Some(parameter) = parameter_of(name) {
        return Ok(config
            .target_parameters
            .iter()
            .flatten()
            .any(|t| parameter == *t || parameter.ends_with(&format!(".{t}"))));
    }
    let targeted = match &config.target_modules {
        None => matches(
            &TargetModules::List(
                DEFAULT_LLAMA_TARGETS
                    .iter()
                    .map(|s| s.to_string())
                    .collect(),
            ),
            name,
        )?,
        Some(TargetModules::AllLinear) => name != "lm_head",
        Some(t) => matches(t, name)?,
    };
    let excluded = match &config.exclude_modules {
        Some(e) => matches(e, name)?,
        None => false,
    };
    Ok(targeted && !excluded)
}

fn pattern_value<T: Copy>(
    patterns: &std::collections::BTreeMap<String, T>,
    name: &str,
) -> Result<Option<T>> {
    for (key, value) in patterns {
        let re = Regex::new(&format!(r"^(?:.*\.)?(?:{key})$"))
            .map_err(|e| Error::InvalidInput(format!("pattern {key:?} is invalid: {e}")))?;
        if re.is_match(name) {
            return Ok(Some(*value));
        }
    }
    Ok(None)
}

/// The rank and alpha of module `name` (from `rank_pattern` / `alpha_pattern`, else `r` / `lora_alpha`; an expert's
/// projection is looked up by its parameter's name, as PEFT does).
pub fn rank_and_alpha(config: &LoraConfig, name: &str) -> Result<(usize, f64)> {
    let parameter = parameter_of(name);
    let name = parameter.as_deref().unwrap_or(name);
    Ok((
        pattern_value(&config.rank_pattern, name)?.unwrap_or(config.r),
        pattern_value(&config.alpha_pattern, name)?.unwrap_or(config.lora_alpha),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    const Q0: &str = "model.layers.0.self_attn.q_proj";
    const D1: &str = "model.layers.1.mlp.down_proj";

    #[test]
    fn list_regex_all_linear_and_exclusions() {
        let mut c = LoraConfig::default();
        assert!(
            is_target(&c, Q0).unwrap() && !is_target(&c, D1).unwrap(),
            "default q_proj, v_proj"
        );
        c.target_modules = Some(TargetModules::AllLinear);
        assert!(is_target(&c, D1).unwrap() && !is_target(&c, "lm_head").unwrap());
        c.target_modules = Some(TargetModules::Regex(r".*\.layers\.1\..*_proj".into()));
        assert!(is_target(&c, D1).unwrap() && !is_target(&c, Q0).unwrap());
        c.target_modules = Some(TargetModules::List(vec!["down_proj".into(), Q0.into()]));
        c.exclude_modules = Some(TargetModules::List(vec![
            "model.layers.1.mlp.down_proj".into()
        ]));
        assert!(is_target(&c, Q0).unwrap() && !is_target(&c, D1).unwrap());
        assert!(!is_target(&c, "model.layers.0.self_attn.q_proj_extra").unwrap());
    }

    #[test]
    fn patterns_match_name_suffixes() {
        let mut c = LoraConfig {
            r: 8,
            lora_alpha: 16.0,
            ..Default::default()
        };
        c.rank_pattern.insert("down_proj".into(), 4);
        c.rank_pattern
            .insert(r"layers\.0\.self_attn\.q_proj".into(), 2);
        c.alpha_pattern.insert("q_proj".into(), 3.0);
        assert_eq!(rank_and_alpha(&c, D1).unwrap(), (4, 16.0));
        assert_eq!(rank_and_alpha(&c, Q0).unwrap(), (2, 3.0));
        assert_eq!(
            rank_and_alpha(&c, "model.layers.1.self_attn.v_proj").unwrap(),
            (8, 16.0)
        );
    }
}
