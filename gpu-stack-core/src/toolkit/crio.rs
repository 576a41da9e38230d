//! CRI-O: a drop-in for `/etc/crio/crio.conf.d/`.
//!
//! CRI-O merges its drop-ins (read in lexical order) key by key, and reads
//! CDI specs without being asked, so the drop-in holds only what differs: a
//! runtime handler, and `cdi_spec_dirs` when directories beyond CRI-O's
//! defaults are wanted.

use toml_edit::{Array, DocumentMut, Item, Table};

use super::RuntimeOptions;

/// Where CRI-O reads CDI specs from when its config does not say.
pub const DEFAULT_CDI_SPEC_DIRS: [&str; 2] = ["/etc/cdi", "/var/run/cdi"];

/// The drop-in text: `[crio.runtime.runtimes.<handler>]` running `runc_path`
/// as an OCI runtime, and `[crio.runtime] cdi_spec_dirs` (CRI-O's defaults
/// plus ours) only when ours go beyond the defaults. Deterministic. With no
/// handler and only default directories it is the comment header alone,
/// still a valid file.
///
/// Names are quoted as TOML needs, so any text renders; check the options
/// with [`RuntimeOptions::validate`] first.
pub fn render_drop_in(opts: &RuntimeOptions, runc_path: &str) -> String {
    render_drop_in_with_monitor(opts, runc_path, None)
}

/// [`render_drop_in`], and the handler's `monitor_path` (conmon) when given.
pub fn render_drop_in_with_monitor(
    opts: &RuntimeOptions,
    runc_path: &str,
    monitor_path: Option<&str>,
) -> String {
    let mut runtime = Table::new();
    runtime.set_implicit(true);

    let mut dirs: Vec<&str> = DEFAULT_CDI_SPEC_DIRS.to_vec();
    for d in &opts.cdi_spec_dirs {
        if !dirs
            .iter()
            .any(|x| x.trim_end_matches('/') == d.trim_end_matches('/'))
        {
            dirs.push(d);
        }
    }
    // Setting the key replaces CRI-O's list, so it is set only when needed,
    // and then with the defaults kept.
    if dirs.len() > DEFAULT_CDI_SPEC_DIRS.len() {
        let arr: Array = dirs.iter().copied().collect();
        runtime.insert("cdi_spec_dirs", toml_edit::value(arr));
    }

    if let Some(handler) = opts.handler() {
        let mut h = Table::new();
        h.insert("runtime_path", toml_edit::value(runc_path));
        h.insert("runtime_type", toml_edit::value("oci"));
        if let Some(m) = monitor_path {
            h.insert("monitor_path", toml_edit::value(m));
        }
        let mut runtimes = Table::new();
        runtimes.set_implicit(true);
        runtimes.insert(handler, Item::Table(h));
        runtime.insert("runtimes", Item::Table(runtimes));
    }

    let mut header = String::from(
        "# Written by gpu-stack's toolkit agent; removed when the toolkit is uninstalled.\n\
         # CRI-O reads CDI specs by itself; this file adds only what differs.\n",
    );
    if runtime.is_empty() {
        header.push_str("# Nothing differs now: no runtime handler, default CDI directories.\n");
        return header;
    }
    let mut crio = Table::new();
    crio.set_implicit(true);
    crio.insert("runtime", Item::Table(runtime));
    let mut doc = DocumentMut::new();
    doc.insert("crio", Item::Table(crio));
    format!("{header}\n{doc}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(dirs: &[&str], handler: Option<&str>) -> RuntimeOptions {
        RuntimeOptions {
            cdi_spec_dirs: dirs.iter().map(|d| d.to_string()).collect(),
            runtime_handler: handler.map(str::to_string),
        }
    }

    const HEADER: &str = "# Written by gpu-stack's toolkit agent; removed when the toolkit is uninstalled.\n\
                          # CRI-O reads CDI specs by itself; this file adds only what differs.\n";

    #[test]
    fn handler_only() {
        let text = render_drop_in(&opts(&["/var/run/cdi/"], Some("nvidia")), "/usr/bin/runc");
        assert_eq!(
            text,
            format!(
                "{HEADER}\n[crio.runtime.runtimes.nvidia]\nruntime_path = \"/usr/bin/runc\"\nruntime_type = \"oci\"\n"
            )
        );
    }

    #[test]
    fn extra_dirs_keep_the_defaults_and_monitor_is_optional() {
        let text = render_drop_in_with_monitor(
            &opts(&["/etc/cdi", "/run/extra-cdi"], Some("gpu.v1")),
            "/usr/local/sbin/runc",
            Some("/usr/libexec/crio/conmon"),
        );
        assert_eq!(
            text,
            format!(
                "{HEADER}\n[crio.runtime]\ncdi_spec_dirs = [\"/etc/cdi\", \"/var/run/cdi\", \"/run/extra-cdi\"]\n\n\
                 [crio.runtime.runtimes.\"gpu.v1\"]\nruntime_path = \"/usr/local/sbin/runc\"\nruntime_type = \"oci\"\n\
                 monitor_path = \"/usr/libexec/crio/conmon\"\n"
            )
        );
        assert!(text.parse::<DocumentMut>().is_ok());
    }

    #[test]
    fn nothing_to_set_is_a_valid_header_only_file() {
        for o in [
            opts(&[], None),
            opts(&["/etc/cdi", "/var/run/cdi"], Some("")),
        ] {
            let text = render_drop_in(&o, "/usr/bin/runc");
            assert!(text.starts_with(HEADER), "{text}");
            assert!(text.lines().all(|l| l.starts_with('#')), "{text}");
            let doc: DocumentMut = text.parse().unwrap();
            assert!(doc.as_table().is_empty());
        }
        let o = opts(&["/run/x"], Some("nvidia"));
        assert_eq!(render_drop_in(&o, "/r"), render_drop_in(&o, "/r"));
    }
}
