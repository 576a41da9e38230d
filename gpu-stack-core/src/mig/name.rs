//! MIG profile names: `[<C>c.]<G>g.<N>gb[+attr[,attr…]|-attr[,attr…]]`.
//!
//! Parsing follows the format rules of NVIDIA's tooling (go-nvlib), so every
//! name users already write in mig-parted files or resource names parses here,
//! and formatting gives back exactly the string that was parsed.
//!
//! A name alone does not identify a profile: `1g.10gb` is a different profile on
//! an A100-40GB than on an H100-80GB. Resolve names per device with
//! [`crate::mig::MigGeometry::resolve`].

use std::fmt;
use std::hash::{Hash, Hasher};
use std::str::FromStr;
use std::sync::Arc;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::echo;

/// Most attributes one profile name may carry (NVIDIA's names carry one or two).
const MAX_ATTRIBUTES: usize = 8;

/// Why a string is not a MIG profile name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "invalid MIG profile name {}: {reason} (expected the form [<C>c.]<G>g.<N>gb[+me|+gfx|+me.all|-me], e.g. \"3g.40gb\" or \"1c.2g.10gb\")",
    crate::echo::quoted(.input)
)]
pub struct ProfileNameError {
    /// The string that failed to parse.
    pub input: String,
    /// What is wrong with it.
    pub reason: String,
}

/// A MIG profile name, kept exactly as written.
///
/// Equality follows NVIDIA's tooling: `1c.1g.5gb` equals `1g.5gb` (the compute
/// count defaults to the GPU-slice count), while the text still round-trips.
#[derive(Clone, Eq)]
pub struct MigProfileName {
    compute: Option<u32>,
    gpu_slices: u32,
    memory_gb: u32,
    negative: bool,
    /// `None` when there are none. Shared, so cloning a name (layouts are
    /// built by cloning profile names) never allocates.
    attributes: Option<Arc<[String]>>,
}

impl fmt::Debug for MigProfileName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MigProfileName")
            .field("compute", &self.compute)
            .field("gpu_slices", &self.gpu_slices)
            .field("memory_gb", &self.memory_gb)
            .field("negative", &self.negative)
            .field("attributes", &self.attributes())
            .finish()
    }
}

/// The media-engine variant a profile name asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum MediaVariant {
    /// No media attribute: the profile's default engine share.
    Default,
    /// `+me`: the one instance that carries the media extensions.
    Me,
    /// `+me.all`: all media engines; only `-me` instances may coexist.
    MeAll,
    /// `-me`: no media engines at all.
    NoMe,
}

impl MigProfileName {
    /// A GPU-instance profile name `<G>g.<N>gb` with no attributes.
    pub fn new(gpu_slices: u32, memory_gb: u32) -> Self {
        MigProfileName {
            compute: None,
            gpu_slices,
            memory_gb,
            negative: false,
            attributes: None,
        }
    }

    /// The same name with one more positive attribute (`+me`, `+gfx`, `+me.all`).
    pub fn with_attribute(mut self, attribute: &str) -> Self {
        self.negative = false;
        self.push_attribute(attribute);
        self
    }

    /// The same name with one more negative attribute (`-me`).
    pub fn without_attribute(mut self, attribute: &str) -> Self {
        self.negative = true;
        self.push_attribute(attribute);
        self
    }

    /// The same name with an explicit compute-slice count (`<C>c.` prefix).
    pub fn with_compute(mut self, compute: u32) -> Self {
        self.compute = Some(compute);
        self
    }

    /// Compute slices (`C`; defaults to `G` when not written).
    pub fn compute_slices(&self) -> u32 {
        self.compute.unwrap_or(self.gpu_slices)
    }

    /// Whether the `<C>c.` prefix was written.
    pub fn has_explicit_compute(&self) -> bool {
        self.compute.is_some()
    }

    /// GPU slices (`G`).
    pub fn gpu_slices(&self) -> u32 {
        self.gpu_slices
    }

    /// Memory in GB as the name states it (`N`).
    pub fn memory_gb(&self) -> u32 {
        self.memory_gb
    }

    /// Attributes in written order (without the sign).
    pub fn attributes(&self) -> &[String] {
        self.attributes.as_deref().unwrap_or(&[])
    }

    fn push_attribute(&mut self, attribute: &str) {
        let mut all = self.attributes().to_vec();
        all.push(attribute.to_string());
        self.attributes = Some(all.into());
    }

    /// Whether the attributes are negative (`-me`).
    pub fn is_negative(&self) -> bool {
        self.negative
    }

    /// Whether this names a whole GPU instance (no compute subdivision).
    pub fn is_gpu_instance(&self) -> bool {
        self.compute_slices() == self.gpu_slices
    }

    /// The GPU-instance profile this compute-instance profile lives in
    /// (drops the `<C>c.` prefix).
    pub fn gpu_instance(&self) -> MigProfileName {
        MigProfileName {
            compute: None,
            ..self.clone()
        }
    }

    /// Whether both names denote the same GPU-instance profile on one GPU:
    /// equal apart from the `<C>c.` prefix. Profile resolution uses this.
    #[inline]
    pub(crate) fn same_gpu_instance(&self, other: &MigProfileName) -> bool {
        self.gpu_slices == other.gpu_slices
            && self.memory_gb == other.memory_gb
            && self.negative == other.negative
            && self.attributes() == other.attributes()
    }

    /// The media variant the attributes select.
    pub fn media_variant(&self) -> MediaVariant {
        let has = |a: &str| self.attributes().iter().any(|x| x == a);
        if self.negative && has("me") {
            MediaVariant::NoMe
        } else if !self.negative && has("me.all") {
            MediaVariant::MeAll
        } else if !self.negative && has("me") {
            MediaVariant::Me
        } else {
            MediaVariant::Default
        }
    }

    /// The form mig-parted uses inside config names: `+` written as `.`
    /// (`1g.5gb+me` → `1g.5gb.me`).
    pub fn config_name_form(&self) -> String {
        self.to_string().replace('+', ".")
    }

    /// Parses a profile name; see the module docs for the grammar.
    pub fn parse(input: &str) -> Result<Self, ProfileNameError> {
        let err = |reason: String| ProfileNameError {
            input: input.to_string(),
            reason,
        };
        if input.is_empty() {
            return Err(err("the name is empty".into()));
        }
        if input.trim() != input {
            return Err(err("the name has leading or trailing whitespace".into()));
        }
        let (base, attrs, negative) = match input.find(['+', '-']) {
            Some(i) => (
                &input[..i],
                Some(&input[i + 1..]),
                input.as_bytes()[i] == b'-',
            ),
            None => (input, None, false),
        };
        let fields: Vec<&str> = base.split('.').collect();
        let (compute, g_field, gb_field) = match fields.as_slice() {
            [g, gb] => (None, *g, *gb),
            [c, g, gb] => (Some(*c), *g, *gb),
            _ => {
                return Err(err(format!(
                    "{} must have two or three '.'-separated fields (<G>g.<N>gb or <C>c.<G>g.<N>gb), found {}",
                    echo::quoted(base),
                    fields.len()
                )));
            }
        };
        let compute = match compute {
            Some(c) => Some(parse_field(c, "c").map_err(err)?),
            None => None,
        };
        let gpu_slices = parse_field(g_field, "g").map_err(err)?;
        let memory_gb = parse_field(gb_field, "gb").map_err(err)?;
        let mut attributes = Vec::new();
        if let Some(attrs) = attrs {
            for attr in attrs.split(',') {
                if attributes.len() == MAX_ATTRIBUTES {
                    return Err(err(format!(
                        "more than {MAX_ATTRIBUTES} attributes; NVIDIA profile names have one or two (+me, +gfx, +me.all, -me)"
                    )));
                }
                check_attribute(attr).map_err(err)?;
                if attributes.iter().any(|a: &String| a == attr) {
                    return Err(err(format!("attribute {} is repeated", echo::quoted(attr))));
                }
                attributes.push(attr.to_string());
            }
        }
        Ok(MigProfileName {
            compute,
            gpu_slices,
            memory_gb,
            negative,
            attributes: (!attributes.is_empty()).then(|| attributes.into()),
        })
    }
}

fn parse_field(field: &str, suffix: &str) -> Result<u32, String> {
    let digits_end = field
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(field.len());
    let (digits, rest) = field.split_at(digits_end);
    if digits.is_empty() {
        return Err(format!(
            "field {} must start with a number followed by {suffix:?}",
            echo::quoted(field)
        ));
    }
    if rest != suffix {
        return Err(format!(
            "field {} must end in exactly {suffix:?}, found {}",
            echo::quoted(field),
            echo::quoted(rest)
        ));
    }
    if digits.len() > 1 && digits.starts_with('0') {
        return Err(format!("field {} has a leading zero", echo::quoted(field)));
    }
    digits
        .parse::<u32>()
        .map_err(|_| format!("number in field {} is too large", echo::quoted(field)))
}

fn check_attribute(attr: &str) -> Result<(), String> {
    if attr.is_empty() {
        return Err("an attribute is empty (check for a trailing '+', '-' or ',')".into());
    }
    if attr.starts_with(|c: char| c.is_ascii_digit()) {
        return Err(format!(
            "attribute {} starts with a digit",
            echo::quoted(attr)
        ));
    }
    if attr.starts_with('.') || attr.ends_with('.') {
        return Err(format!(
            "attribute {} starts or ends with '.'",
            echo::quoted(attr)
        ));
    }
    if let Some(bad) = attr
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || *c == '.'))
    {
        return Err(format!(
            "attribute {} contains {bad:?}; attributes are letters, digits and '.', and '+' and '-' attributes cannot be mixed",
            echo::quoted(attr)
        ));
    }
    Ok(())
}

impl PartialEq for MigProfileName {
    fn eq(&self, other: &Self) -> bool {
        self.compute_slices() == other.compute_slices()
            && self.gpu_slices == other.gpu_slices
            && self.memory_gb == other.memory_gb
            && self.negative == other.negative
            && self.attributes() == other.attributes()
    }
}

impl Hash for MigProfileName {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.compute_slices().hash(state);
        self.gpu_slices.hash(state);
        self.memory_gb.hash(state);
        self.negative.hash(state);
        self.attributes().hash(state);
    }
}

impl PartialOrd for MigProfileName {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for MigProfileName {
    /// Larger instances first (G, then C, then memory, descending), then
    /// attributes: the order mig-parted flattens configs in.
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        other
            .gpu_slices
            .cmp(&self.gpu_slices)
            .then(other.compute_slices().cmp(&self.compute_slices()))
            .then(other.memory_gb.cmp(&self.memory_gb))
            .then(self.negative.cmp(&other.negative))
            .then(self.attributes().cmp(other.attributes()))
    }
}

impl fmt::Display for MigProfileName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(c) = self.compute {
            write!(f, "{c}c.")?;
        }
        write!(f, "{}g.{}gb", self.gpu_slices, self.memory_gb)?;
        if !self.attributes().is_empty() {
            f.write_str(if self.negative { "-" } else { "+" })?;
            f.write_str(&self.attributes().join(","))?;
        }
        Ok(())
    }
}

impl FromStr for MigProfileName {
    type Err = ProfileNameError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        MigProfileName::parse(s)
    }
}

impl Serialize for MigProfileName {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for MigProfileName {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        MigProfileName::parse(&s).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]

        /// Parse errors of names, placed instances, layouts and demands stay
        /// small whatever the size of the input (names, starts, counts and
        /// attribute lists of any length), and a name with more attributes
        /// than NVIDIA uses is refused.
        #[test]
        fn parse_errors_stay_small(len in 0usize..40_000, which in 0usize..7) {
            let big = "x".repeat(len);
            let attrs = vec!["a"; len / 2 + 9].join(",");
            let input = match which {
                0 => big.clone(),
                1 => format!("1g.{big}gb"),
                2 => format!("1g.10gb+{attrs}"),
                3 => format!("1g.10gb@{big}"),
                4 => format!("3g.40gb@0,{big}"),
                5 => format!("1g.10gb={big}"),
                _ => format!("{big}=1"),
            };
            let errors = [
                MigProfileName::parse(&input).err().map(|e| e.to_string()),
                crate::mig::parse_layout(&input).err().map(|e| e.to_string()),
                crate::mig::parse_demand(&input).err().map(|e| e.to_string()),
            ];
            let mut any = false;
            for e in errors.into_iter().flatten() {
                any = true;
                proptest::prop_assert!(e.len() < 1_000, "{} bytes: {}", e.len(), &e[..200]);
            }
            proptest::prop_assert!(any || len == 0);
        }
    }

    #[test]
    fn valid_formats_round_trip() {
        for s in [
            "1g.5gb",
            "1c.1g.5gb",
            "1g.5gb+me",
            "1c.1g.5gb+me",
            "1c.1g.5gb-me",
            "1g.5gb+me.all",
            "1c.1g.5gb+me.all",
            "1g.5gb+gfx",
            "1c.1g.5gb+gfx",
            "0g.0gb",
            "0c.0g.0gb",
            "10000g.500000gb",
            "1g.5gb+me,you,them",
        ] {
            let p = MigProfileName::parse(s).unwrap_or_else(|e| panic!("{s}: {e}"));
            assert_eq!(p.to_string(), s);
        }
    }

    #[test]
    fn invalid_formats_are_rejected() {
        for s in [
            "",
            " 1c.1g.5gb",
            "1 c.1g.5gb",
            "1c.f1g.5gb",
            "1r.1g.5gb",
            "1g.5gbk",
            "1g.5",
            "g.5gb",
            "1g.gb",
            "1g.5gb+me,me",
            "1g.5gb+",
            "1g.5gb+me,",
            "1g.5gb+2me",
            "1g.5gb*me",
            "1c.1g.5gb+.all",
            "1c.1g.5gb+all.",
            "1c.1g.5gb+me-me",
            "1c.1g.5gb-me+me",
            "bogus",
        ] {
            assert!(
                MigProfileName::parse(s).is_err(),
                "{s:?} should be rejected"
            );
        }
    }

    #[test]
    fn equality_follows_nvidia_tooling() {
        let p = |s: &str| MigProfileName::parse(s).unwrap();
        assert_eq!(p("1c.1g.5gb"), p("1g.5gb"));
        assert_ne!(p("1c.2g.10gb"), p("2c.2g.10gb"));
        assert_ne!(p("1g.5gb"), p("1g.5gb+me"));
        assert_ne!(p("1g.5gb+me"), p("1g.5gb-me"));
        assert_ne!(p("1g.5gb"), p("1g.5gb-me"));
    }

    #[test]
    fn media_variants() {
        let p = |s: &str| MigProfileName::parse(s).unwrap().media_variant();
        assert_eq!(p("1g.24gb"), MediaVariant::Default);
        assert_eq!(p("1g.24gb+me"), MediaVariant::Me);
        assert_eq!(p("1g.24gb+me.all"), MediaVariant::MeAll);
        assert_eq!(p("1g.24gb-me"), MediaVariant::NoMe);
        assert_eq!(p("1g.24gb+gfx"), MediaVariant::Default);
    }

    #[test]
    fn errors_say_what_is_wrong() {
        let e = MigProfileName::parse("1g.5gbk").unwrap_err();
        assert!(e.to_string().contains("\"gb\""), "{e}");
        let e = MigProfileName::parse("1g.5gb+me,me").unwrap_err();
        assert!(e.to_string().contains("repeated"), "{e}");
    }
}
