//! Revocation lists: a revoked peer fails the chain check both ways, a
//! new file applies, a bad one keeps the last good lists, a missing one is
//! waited for, an open connection learns of its peer's revocation.

use rcgen::{
    BasicConstraints, CertificateParams, CertificateRevocationListParams, ExtendedKeyUsagePurpose,
    IsCa, Issuer, KeyIdMethod, KeyPair, KeyUsagePurpose, RevokedCertParams, SanType, SerialNumber,
};
use rustls_pki_types::{CertificateDer, UnixTime};
use time::OffsetDateTime;

use super::*;
use crate::tls::TrustRoots;

struct Ca {
    root: CertificateDer<'static>,
    issuer: Issuer<'static, KeyPair>,
}

fn ca() -> Ca {
    let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).expect("key");
    let mut params = CertificateParams::default();
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let root = params.self_signed(&key).expect("root").der().clone();
    Ca {
        root,
        issuer: Issuer::new(params, key),
    }
}

/// A workload certificate of `sa` with serial `serial`.
fn leaf(ca: &Ca, sa: &str, serial: u64) -> CertificateDer<'static> {
    let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).expect("key");
    let mut params = CertificateParams::default();
    params.subject_alt_names = vec![SanType::URI(
        format!("spiffe://cluster.local/ns/default/sa/{sa}")
            .try_into()
            .expect("uri"),
    )];
    params.is_ca = IsCa::ExplicitNoCa;
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![
        ExtendedKeyUsagePurpose::ServerAuth,
        ExtendedKeyUsagePurpose::ClientAuth,
    ];
    params.serial_number = Some(SerialNumber::from(serial));
    params
        .signed_by(&key, &ca.issuer)
        .expect("leaf")
        .der()
        .clone()
}

/// A CRL of `ca` revoking `serials`, PEM.
fn crl(ca: &Ca, number: u64, serials: &[u64]) -> String {
    let now = OffsetDateTime::now_utc();
    CertificateRevocationListParams {
        this_update: now - time::Duration::hours(1),
        next_update: now + time::Duration::hours(1),
        crl_number: SerialNumber::from(number),
        issuing_distribution_point: None,
        revoked_certs: serials
            .iter()
            .map(|s| RevokedCertParams {
                serial_number: SerialNumber::from(*s),
                revocation_time: now - time::Duration::minutes(5),
                reason_code: None,
                invalidity_date: None,
            })
            .collect(),
        key_identifier_method: KeyIdMethod::Sha256,
    }
    .signed_by(&ca.issuer)
    .expect("crl")
    .pem()
    .expect("pem")
}

/// Whether `roots` accept `cert` as a client and as a server.
fn accepted(roots: &TrustRoots, cert: &CertificateDer<'static>) -> [Result<(), String>; 2] {
    let now = UnixTime::now();
    [
        crate::tls::check_chain(roots, cert, now, webpki::KeyUsage::client_auth()),
        crate::tls::check_chain(roots, cert, now, webpki::KeyUsage::server_auth()),
    ]
}

#[test]
fn a_revoked_certificate_fails_both_ways_and_others_pass() {
    let ca = ca();
    let (revoked, kept) = (leaf(&ca, "gone", 7), leaf(&ca, "web", 8));
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("ca-crl.pem");
    std::fs::write(&path, crl(&ca, 1, &[7])).expect("write");
    let roots = TrustRoots::new(std::slice::from_ref(&ca.root))
        .expect("roots")
        .with_revocations(Revocations::load(&path).expect("loads"));
    for verdict in accepted(&roots, &revoked) {
        let e = verdict.expect_err("revoked");
        assert!(e.contains("Revoked"), "{e}");
    }
    assert_eq!(accepted(&roots, &kept), [Ok(()), Ok(())]);
    // Without lists, both pass.
    let open = TrustRoots::new(std::slice::from_ref(&ca.root)).expect("roots");
    assert_eq!(accepted(&open, &revoked), [Ok(()), Ok(())]);
}

#[test]
fn a_changed_file_applies_and_a_bad_one_keeps_the_last_good_lists() {
    let ca = ca();
    let (seven, eight) = (leaf(&ca, "a", 7), leaf(&ca, "b", 8));
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("ca-crl.pem");
    std::fs::write(&path, crl(&ca, 1, &[7])).expect("write");
    let revocations = Revocations::load(&path).expect("loads");
    let roots = TrustRoots::new(std::slice::from_ref(&ca.root))
        .expect("roots")
        .with_revocations(revocations.clone());
    assert!(!revocations.reload_if_changed().expect("unchanged"));
    assert!(accepted(&roots, &seven)[0].is_err() && accepted(&roots, &eight)[0].is_ok());
    // A new list (two serials: a new length, whatever the clock).
    std::fs::write(&path, crl(&ca, 2, &[8, 9])).expect("write");
    assert!(revocations.reload_if_changed().expect("reloaded"));
    assert!(accepted(&roots, &seven)[0].is_ok() && accepted(&roots, &eight)[0].is_err());
    // Not a CRL: named, and the last good one stays.
    std::fs::write(
        &path,
        "-----BEGIN X509 CRL-----\nbm90IGEgY3Js\n-----END X509 CRL-----\n",
    )
    .expect("write");
    let e = revocations.reload_if_changed().expect_err("does not parse");
    assert!(e.to_string().contains("list 0 does not parse"), "{e}");
    assert!(
        accepted(&roots, &eight)[0].is_err(),
        "still the last good lists"
    );
}

#[test]
fn a_missing_file_revokes_nothing_until_it_appears() {
    let ca = ca();
    let seven = leaf(&ca, "a", 7);
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("ca-crl.pem");
    let revocations = Revocations::load(&path).expect("a missing file is waited for");
    assert!(revocations.waiting());
    let roots = TrustRoots::new(std::slice::from_ref(&ca.root))
        .expect("roots")
        .with_revocations(revocations.clone());
    assert_eq!(accepted(&roots, &seven), [Ok(()), Ok(())]);
    assert!(!revocations.reload_if_changed().expect("still none"));
    std::fs::write(&path, crl(&ca, 1, &[7])).expect("write");
    assert!(revocations.reload_if_changed().expect("appeared"));
    assert!(!revocations.waiting());
    assert!(accepted(&roots, &seven)[0].is_err());
    // Gone again: named, and the lists stay in force.
    std::fs::remove_file(&path).expect("remove");
    let e = revocations.reload_if_changed().expect_err("gone");
    assert!(e.to_string().contains("is gone"), "{e}");
    assert!(accepted(&roots, &seven)[0].is_err(), "still revoked");
    // Reported once, not at every look.
    assert!(!revocations.reload_if_changed().expect("still gone"));
}

#[test]
fn an_unreadable_file_is_refused_at_load_naming_it_an_empty_one_revokes_nothing() {
    let dir = tempfile::tempdir().expect("dir");
    // A directory where the file should be: it exists, it cannot be read.
    let e = Revocations::load(dir.path()).expect_err("not a file");
    assert!(
        e.to_string().contains(&dir.path().display().to_string()),
        "{e}"
    );
    // An empty one (a ConfigMap key with no list yet) revokes nothing.
    let empty = dir.path().join("empty.pem");
    std::fs::write(&empty, "").expect("write");
    assert!(
        Revocations::load(&empty)
            .expect("loads")
            .current()
            .is_empty()
    );
}

/// An open connection's watch ends when a reload revokes its peer's chain,
/// not on a reload that revokes someone else, nor without lists.
#[test]
fn an_open_connection_learns_its_peer_was_revoked_on_reload() {
    use futures::FutureExt as _;
    let ca = ca();
    let (seven, eight) = (leaf(&ca, "a", 7), leaf(&ca, "b", 8));
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("ca-crl.pem");
    std::fs::write(&path, "").expect("write");
    let revocations = Revocations::load(&path).expect("loads");
    let roots = TrustRoots::new(std::slice::from_ref(&ca.root))
        .expect("roots")
        .with_revocations(revocations.clone());
    let watch = |cert: &CertificateDer<'static>| {
        let w = roots
            .revocation_watch(webpki::KeyUsage::client_auth())
            .expect("lists are configured");
        Box::pin(crate::tls::until_chain_revoked(
            Some((w, vec![cert.clone()])),
            UnixTime::now(),
        ))
    };
    let (mut on_seven, mut on_eight) = (watch(&seven), watch(&eight));
    assert!((&mut on_seven).now_or_never().is_none(), "nothing reloaded");
    std::fs::write(&path, crl(&ca, 1, &[7])).expect("write");
    assert!(revocations.reload_if_changed().expect("reloaded"));
    assert!((&mut on_seven).now_or_never().is_some(), "seven is revoked");
    assert!((&mut on_eight).now_or_never().is_none(), "eight is not");
    // Without lists there is nothing to watch.
    let open = TrustRoots::new(std::slice::from_ref(&ca.root)).expect("roots");
    assert!(
        open.revocation_watch(webpki::KeyUsage::client_auth())
            .is_none()
    );
}

/// At start, a file that does not parse is named and revokes nothing; the
/// next good file applies as any reload.
#[test]
fn an_unusable_file_at_start_revokes_nothing_until_a_good_one() {
    let ca = ca();
    let seven = leaf(&ca, "a", 7);
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("ca-crl.pem");
    std::fs::write(
        &path,
        "-----BEGIN X509 CRL-----\nbm90IGEgY3Js\n-----END X509 CRL-----\n",
    )
    .expect("write");
    let (revocations, error) = Revocations::load_or_wait(&path);
    let e = error.expect("the bad file is named");
    assert!(e.to_string().contains("ca-crl.pem"), "{e}");
    let roots = TrustRoots::new(std::slice::from_ref(&ca.root))
        .expect("roots")
        .with_revocations(revocations.clone());
    assert_eq!(accepted(&roots, &seven), [Ok(()), Ok(())]);
    assert!(
        !revocations.reload_if_changed().expect("unchanged"),
        "reported at start, not again"
    );
    std::fs::write(&path, crl(&ca, 1, &[7])).expect("write");
    assert!(revocations.reload_if_changed().expect("a good file"));
    assert!(accepted(&roots, &seven)[0].is_err());
}
