//! An output kept apart from the inputs it is made from: a command that writes a folder (or file) from inputs
//! refuses an output that is, is inside, or contains one of them, whatever `--overwrite` says, since replacing or
//! filling it would destroy what the command reads. Paths are compared as the file system resolves them (symlinks
//! followed, `..` taken), also for an output that does not exist yet, so no spelling of a path gets past.

use std::path::{Component, Path, PathBuf};

use crate::error::{Error, Result};

/// `path` as the file system resolves it, or will once it is created: its longest existing beginning
/// canonicalized (symlinks resolved), and the rest appended with `.` dropped and `..` taking one name off (a folder
/// that does not exist yet holds no symlink, and `create_dir_all` makes the folders before a `..`, so this is where
/// the path will lead).
pub fn real_path(path: &Path) -> Result<PathBuf> {
    let absolute = if path.is_absolute() {
        path.to_path_buf()
    } else {
        std::env::current_dir()
            .map_err(|e| Error::io("cannot read", "the working directory", e))?
            .join(path)
    };
    let parts: Vec<Component> = absolute.components().collect();
    for existing in (1..=parts.len()).rev() {
        let Ok(mut real) = parts[..existing].iter().collect::<PathBuf>().canonicalize() else {
            continue;
        };
        for part in &parts[existing..] {
            match part {
                Component::ParentDir => {
                    real.pop();
                }
                Component::Normal(name) => real.push(name),
                Component::CurDir | Component::RootDir | Component::Prefix(_) => {}
            }
        }
        return Ok(real);
    }
    // Only a root that does not resolve gets here; the path as written is all there is to compare.
    Ok(absolute)
}

/// How an output and an input overlap.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Overlap {
    Same,
    Inside,
    Contains,
}

/// How `output` overlaps `input` (both real paths), if it does.
fn overlap(output: &Path, input: &Path) -> Option<Overlap> {
    if output == input {
        Some(Overlap::Same)
    } else if output.starts_with(input) {
        Some(Overlap::Inside)
    } else if input.starts_with(output) {
        Some(Overlap::Contains)
    } else {
        None
    }
}

/// An error when `output` (the path a command writes, named by `output_key`, a flag or config key) is, is inside,
/// or contains one of `inputs` (each a key or flag and the path it names): the message names both as the user
/// wrote them, their real path where the spelling differs, and an output beside them that is apart from every
/// input (its name ending in `-{suffix}`). Inputs that do not exist (a Hub id) overlap nothing.
pub fn check_output_apart(
    (output_key, output): (&str, &Path),
    inputs: &[(&str, &Path)],
    suffix: &str,
) -> Result<()> {
    let real_output = real_path(output)?;
    let mut real_inputs = Vec::new();
    for (key, input) in inputs {
        if input.exists() {
            real_inputs.push((*key, *input, real_path(input)?));
        }
    }
    for (key, input, real_input) in &real_inputs {
        let Some(how) = overlap(&real_output, real_input) else {
            continue;
        };
        let relation = match how {
            Overlap::Same => "is",
            Overlap::Inside => "is inside",
            Overlap::Contains => "contains",
        };
        let real = if how == Overlap::Same && (real_output != output || real_input != input) {
            format!(" (both are `{}`)", real_output.display())
        } else {
            String::new()
        };
        // A sibling of the outer of the two, checked against every input before it is offered.
        let outer = if how == Overlap::Contains {
            &real_output
        } else {
            real_input
        };
        let name = outer.file_name().unwrap_or_default().to_string_lossy();
        let candidate = outer.with_file_name(format!("{name}-{suffix}"));
        let advice = if !name.is_empty()
            && !candidate.exists()
            && real_inputs
                .iter()
                .all(|(_, _, i)| overlap(&candidate, i).is_none())
        {
            format!(", e.g. `{}`", candidate.display())
        } else {
            String::new()
        };
        return Err(Error::InvalidInput(format!(
            "{output_key} `{}` {relation} {key} `{}`{real}: writing there would replace or delete what it reads, \
             with or without overwriting allowed; choose an output apart from every input{advice}",
            output.display(),
            input.display()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn real_paths_follow_links_and_dots_also_where_nothing_exists_yet() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().canonicalize().unwrap();
        std::fs::create_dir(root.join("a")).unwrap();
        assert_eq!(
            real_path(&root.join("a/./b/../c")).unwrap(),
            root.join("a/c")
        );
        assert_eq!(real_path(&root.join("x/../a")).unwrap(), root.join("a"));
        #[cfg(unix)]
        {
            std::os::unix::fs::symlink(root.join("a"), root.join("link")).unwrap();
            assert_eq!(
                real_path(&root.join("link/new")).unwrap(),
                root.join("a/new")
            );
        }
    }

    #[test]
    fn an_output_that_is_inside_or_contains_an_input_is_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        for d in ["base", "adapter"] {
            std::fs::create_dir(root.join(d)).unwrap();
        }
        let inputs = [
            ("--model", &*root.join("base")),
            ("--adapter", &*root.join("adapter")),
        ];
        let check = |out: &Path| check_output_apart(("--output", out), &inputs, "merged");
        for (out, says) in [
            (root.join("adapter"), "is --adapter"),
            (root.join("base/../adapter/"), "is --adapter"),
            (root.join("adapter/merged"), "is inside --adapter"),
            (root.join("missing/../base/deep/er"), "is inside --model"),
            (root.to_path_buf(), "contains --model"),
        ] {
            let err = check(&out).unwrap_err().to_string();
            assert!(err.contains(says), "{out:?}: {err}");
            assert!(
                err.contains("choose an output apart from every input"),
                "{err}"
            );
        }
        let err = check(&root.join("adapter")).unwrap_err().to_string();
        assert!(err.contains("adapter-merged`"), "{err}");
        check(&root.join("merged")).unwrap();
        check(&root.join("adapterx")).unwrap();
        // A Hub id names no folder here, and overlaps nothing.
        check_output_apart(
            ("--output", root),
            &[("--model", Path::new("org/name"))],
            "m",
        )
        .unwrap();
    }
}
