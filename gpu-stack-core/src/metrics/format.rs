//! Value and text formatting as dcgm-exporter prints it: integers with `%d`,
//! doubles with `%f` (six decimals); label values and help texts escaped as the
//! exposition formats require.

use std::fmt::Write as _;

/// A sampled field value.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Value {
    /// An integer field, printed plain.
    Int(i64),
    /// A floating-point field, printed with six decimals.
    Double(f64),
}

/// Appends `value` the way dcgm-exporter prints it. Returns `false` (and
/// appends nothing) for values that have no meaningful text: NaN and infinities,
/// which stand for "no value" and are omitted like DCGM's blank sentinels.
pub fn write_value(out: &mut String, value: Value) -> bool {
    match value {
        Value::Int(v) => {
            let _ = write!(out, "{v}");
            true
        }
        Value::Double(v) if v.is_finite() => {
            let _ = write!(out, "{v:.6}");
            true
        }
        Value::Double(_) => false,
    }
}

/// Appends a label value with `\`, `"` and newlines escaped.
pub fn write_label_value(out: &mut String, value: &str) {
    for c in value.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
}

/// Appends a help text with `\` and newlines escaped (and `"` in OpenMetrics).
pub fn write_help(out: &mut String, help: &str, openmetrics: bool) {
    for c in help.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '"' if openmetrics => out.push_str("\\\""),
            c => out.push(c),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn fmt(v: Value) -> Option<String> {
        let mut s = String::new();
        write_value(&mut s, v).then_some(s)
    }

    #[test]
    fn doubles_have_six_decimals_and_ints_are_plain() {
        assert_eq!(fmt(Value::Double(30.982)).as_deref(), Some("30.982000"));
        assert_eq!(fmt(Value::Double(0.0)).as_deref(), Some("0.000000"));
        assert_eq!(fmt(Value::Double(412.5)).as_deref(), Some("412.500000"));
        assert_eq!(fmt(Value::Int(1410)).as_deref(), Some("1410"));
        assert_eq!(fmt(Value::Int(-3)).as_deref(), Some("-3"));
        assert_eq!(fmt(Value::Double(f64::NAN)), None);
        assert_eq!(fmt(Value::Double(f64::INFINITY)), None);
    }

    #[test]
    fn label_values_are_escaped() {
        let mut s = String::new();
        write_label_value(&mut s, "a\"b\\c\nd");
        assert_eq!(s, "a\\\"b\\\\c\\nd");
    }

    proptest! {
        #[test]
        fn finite_doubles_parse_back_within_rounding(v in -1.0e12f64..1.0e12) {
            let s = fmt(Value::Double(v)).unwrap();
            let back: f64 = s.parse().unwrap();
            prop_assert!((back - v).abs() <= 0.0000005 + v.abs() * 1e-15);
            let decimals = s.split('.').nth(1).unwrap();
            prop_assert_eq!(decimals.len(), 6);
        }

        #[test]
        fn escaped_label_values_have_no_raw_quotes_or_newlines(v in ".{0,40}") {
            let mut s = String::new();
            write_label_value(&mut s, &v);
            prop_assert!(!s.contains('\n'));
            let unescaped_quote = s.char_indices().any(|(i, c)| c == '"' && {
                let backslashes = s[..i].chars().rev().take_while(|&b| b == '\\').count();
                backslashes % 2 == 0
            });
            prop_assert!(!unescaped_quote);
        }
    }
}
