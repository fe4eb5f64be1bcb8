//! Enums that users write by name — in configs, on the command line, in files other tools read — declared once
//! with their names: [`named_enum!`] gives each `as_str`, `FromStr` (an error listing the valid names), `Display`,
//! and serde as those strings; [`one_or_many`] reads a setting written as one name or a list of them.

/// A setting written as one name or a list of names (as transformers and TRL accept `report_to` and `loss_type`),
/// each parsed with `FromStr`, whose error becomes the deserializer's; for `#[serde(deserialize_with)]`.
pub(crate) fn one_or_many<'de, D, T>(d: D) -> std::result::Result<Vec<T>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: std::str::FromStr,
    T::Err: std::fmt::Display,
{
    #[derive(serde::Deserialize)]
    #[serde(untagged)]
    enum OneOrMany {
        One(String),
        Many(Vec<String>),
    }
    let names = match <OneOrMany as serde::Deserialize>::deserialize(d) {
        Ok(OneOrMany::One(n)) => vec![n],
        Ok(OneOrMany::Many(ns)) => ns,
        Err(_) => {
            return Err(serde::de::Error::custom(
                "expected a name or a list of names",
            ))
        }
    };
    names
        .iter()
        .map(|n| n.parse().map_err(serde::de::Error::custom))
        .collect()
}

/// Declares an enum whose values are read and written by name (the first name of each variant is canonical, the
/// others are accepted aliases). `$what` names the setting in errors (`optim`, `lr_scheduler_type`, ...).
macro_rules! named_enum {
    (
        $(#[$meta:meta])*
        $vis:vis enum $name:ident ($what:literal) {
            $(
                $(#[$vmeta:meta])*
                $variant:ident = $canonical:literal $(| $alias:literal)*
            ),+ $(,)?
        }
    ) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
        #[serde(try_from = "String", into = "String")]
        $vis enum $name {
            $($(#[$vmeta])* $variant),+
        }

        impl $name {
            /// Every value, in declaration order.
            pub const ALL: &'static [$name] = &[$($name::$variant),+];

            /// Every name with its aliases, for error messages: `a (alias), b`.
            fn names_with_aliases() -> String {
                let names: Vec<String> = vec![$({
                    let aliases: Vec<&str> = vec![$($alias),*];
                    if aliases.is_empty() {
                        $canonical.to_string()
                    } else {
                        format!("{} ({})", $canonical, aliases.join(", "))
                    }
                }),+];
                names.join(", ")
            }

            /// The canonical name.
            pub fn as_str(self) -> &'static str {
                match self {
                    $($name::$variant => $canonical),+
                }
            }
        }

        impl std::str::FromStr for $name {
            type Err = $crate::error::Error;
            fn from_str(s: &str) -> $crate::error::Result<Self> {
                match s {
                    $($canonical $(| $alias)* => Ok($name::$variant),)+
                    other => Err($crate::error::Error::InvalidInput(format!(
                        "{} `{other}` is not supported; use {}",
                        $what,
                        $name::names_with_aliases()
                    ))),
                }
            }
        }

        impl TryFrom<String> for $name {
            type Error = $crate::error::Error;
            fn try_from(s: String) -> $crate::error::Result<Self> {
                s.parse()
            }
        }

        impl From<$name> for String {
            fn from(value: $name) -> String {
                value.as_str().to_string()
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }
    };
}

pub(crate) use named_enum;

#[cfg(test)]
mod tests {
    named_enum! {
        /// A test enum.
        enum Color ("color") {
            /// Red.
            Red = "red" | "rouge",
            /// Blue.
            Blue = "blue",
        }
    }

    #[test]
    fn names_round_trip_aliases_parse_and_errors_list_the_names() {
        assert_eq!("rouge".parse::<Color>().unwrap(), Color::Red);
        assert_eq!(Color::ALL, [Color::Red, Color::Blue]);
        assert_eq!(Color::Red.to_string(), "red");
        let json = serde_json::to_string(&Color::Blue).unwrap();
        assert_eq!(json, "\"blue\"");
        assert_eq!(serde_json::from_str::<Color>(&json).unwrap(), Color::Blue);
        let err = "green".parse::<Color>().unwrap_err().to_string();
        assert!(
            err.contains("color `green`") && err.contains("red (rouge), blue"),
            "{err}"
        );
    }
}
