//! Throwaway certificates for the test cluster: one CA that signs the
//! apiserver's serving certificate and the admin client certificate, plus the
//! service-account signing key. Everything lives in the state directory and is
//! deleted with it.
use std::fs;
use std::path::Path;

use anyhow::{Context, Result};
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};

/// Writes `ca.crt`, `apiserver.{crt,key}`, `admin.{crt,key}` and `sa.{key,pub}` into `dir`.
pub fn generate(dir: &Path) -> Result<()> {
    fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;

    let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
    ca_params
        .distinguished_name
        .push(DnType::CommonName, "gpu-stack-test-ca");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate()?)?;
    write(dir, "ca.crt", &ca.pem())?;

    let mut serving = CertificateParams::new(vec![
        "localhost".to_string(),
        "127.0.0.1".to_string(),
        "10.0.0.1".to_string(),
        "kubernetes".to_string(),
        "kubernetes.default".to_string(),
        "kubernetes.default.svc".to_string(),
    ])?;
    serving
        .distinguished_name
        .push(DnType::CommonName, "kube-apiserver");
    serving.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    let serving_key = KeyPair::generate()?;
    let serving_cert = serving.signed_by(&serving_key, &ca)?;
    write(dir, "apiserver.crt", &serving_cert.pem())?;
    write(dir, "apiserver.key", &serving_key.serialize_pem())?;

    let mut admin = CertificateParams::new(Vec::<String>::new())?;
    admin
        .distinguished_name
        .push(DnType::CommonName, "gpu-stack-admin");
    admin
        .distinguished_name
        .push(DnType::OrganizationName, "system:masters");
    admin.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    let admin_key = KeyPair::generate()?;
    let admin_cert = admin.signed_by(&admin_key, &ca)?;
    write(dir, "admin.crt", &admin_cert.pem())?;
    write(dir, "admin.key", &admin_key.serialize_pem())?;

    let sa = KeyPair::generate()?;
    write(dir, "sa.key", &sa.serialize_pem())?;
    write(dir, "sa.pub", &sa.public_key_pem())?;
    Ok(())
}

fn write(dir: &Path, name: &str, contents: &str) -> Result<()> {
    let path = dir.join(name);
    fs::write(&path, contents).with_context(|| format!("writing {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_ca_serving_client_and_service_account_material() {
        let dir = std::env::temp_dir().join(format!("gpu-stack-pki-test-{}", std::process::id()));
        generate(&dir).unwrap();
        let read = |name: &str| fs::read_to_string(dir.join(name)).unwrap();
        for cert in ["ca.crt", "apiserver.crt", "admin.crt"] {
            assert!(
                read(cert).starts_with("-----BEGIN CERTIFICATE-----"),
                "{cert}"
            );
        }
        for key in ["apiserver.key", "admin.key", "sa.key"] {
            assert!(read(key).contains("PRIVATE KEY-----"), "{key}");
        }
        assert!(read("sa.pub").starts_with("-----BEGIN PUBLIC KEY-----"));
        fs::remove_dir_all(&dir).unwrap();
    }
}
