//! Optional TLS (rustls with the ring provider): server certificate and key,
//! optional client-certificate verification (mutual TLS).

use std::path::Path;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::server::WebPkiClientVerifier;
use rustls::RootCertStore;
use tokio::net::TcpStream;

use super::BoxIo;
use crate::error::{Error, Result};

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn certs(path: &Path) -> Result<Vec<CertificateDer<'static>>> {
    let v: Vec<_> = CertificateDer::pem_file_iter(path)
        .map_err(|e| Error::Tls(format!("reading certificates from {}: {e}", path.display())))?
        .collect::<std::result::Result<_, _>>()
        .map_err(|e| Error::Tls(format!("parsing certificates in {}: {e}", path.display())))?;
    if v.is_empty() {
        return Err(Error::Tls(format!(
            "expected PEM certificates in {}, found none",
            path.display()
        )));
    }
    Ok(v)
}

fn key(path: &Path) -> Result<PrivateKeyDer<'static>> {
    PrivateKeyDer::from_pem_file(path).map_err(|e| {
        Error::Tls(format!(
            "reading a PEM private key from {}: {e}",
            path.display()
        ))
    })
}

fn roots(path: &Path) -> Result<RootCertStore> {
    let mut r = RootCertStore::empty();
    for c in certs(path)? {
        r.add(c)
            .map_err(|e| Error::Tls(format!("CA certificate in {}: {e}", path.display())))?;
    }
    Ok(r)
}

/// TLS settings of a relay's listener.
#[derive(Clone)]
pub struct ServerTls {
    acceptor: tokio_rustls::TlsAcceptor,
}

impl std::fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ServerTls")
    }
}

impl ServerTls {
    /// Certificate chain and key (PEM); with `client_ca`, clients must present a
    /// certificate signed by it (mutual TLS).
    pub fn from_pem_files(cert: &Path, key_path: &Path, client_ca: Option<&Path>) -> Result<Self> {
        let b = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| Error::Tls(e.to_string()))?;
        let b = match client_ca {
            None => b.with_no_client_auth(),
            Some(ca) => {
                let v =
                    WebPkiClientVerifier::builder_with_provider(Arc::new(roots(ca)?), provider())
                        .build()
                        .map_err(|e| Error::Tls(format!("client CA {}: {e}", ca.display())))?;
                b.with_client_cert_verifier(v)
            }
        };
        let cfg = b
            .with_single_cert(certs(cert)?, key(key_path)?)
            .map_err(|e| {
                Error::Tls(format!(
                    "certificate {} with key {}: {e}",
                    cert.display(),
                    key_path.display()
                ))
            })?;
        Ok(ServerTls {
            acceptor: tokio_rustls::TlsAcceptor::from(Arc::new(cfg)),
        })
    }

    pub(crate) async fn accept(&self, tcp: TcpStream) -> Result<BoxIo> {
        let s = self
            .acceptor
            .accept(tcp)
            .await
            .map_err(|e| Error::Tls(format!("handshake with a client: {e}")))?;
        Ok(Box::new(s))
    }
}

/// TLS settings of a connection to a relay.
#[derive(Clone)]
pub struct ClientTls {
    connector: tokio_rustls::TlsConnector,
    server_name: Option<String>,
}

impl std::fmt::Debug for ClientTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientTls")
            .field("server_name", &self.server_name)
            .finish()
    }
}

impl ClientTls {
    /// Trust `ca` (PEM); present `client_cert_key` when the relay asks (mutual TLS).
    pub fn from_pem_files(ca: &Path, client_cert_key: Option<(&Path, &Path)>) -> Result<Self> {
        let b = rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| Error::Tls(e.to_string()))?
            .with_root_certificates(roots(ca)?);
        let cfg = match client_cert_key {
            None => b.with_no_client_auth(),
            Some((c, k)) => b
                .with_client_auth_cert(certs(c)?, key(k)?)
                .map_err(|e| Error::Tls(format!("client certificate {}: {e}", c.display())))?,
        };
        Ok(ClientTls {
            connector: tokio_rustls::TlsConnector::from(Arc::new(cfg)),
            server_name: None,
        })
    }

    /// Verify the relay's certificate against this name instead of the host in its address.
    pub fn with_server_name(mut self, name: impl Into<String>) -> Self {
        self.server_name = Some(name.into());
        self
    }

    pub(crate) async fn connect(&self, addr: &str, tcp: TcpStream) -> Result<BoxIo> {
        let host = match &self.server_name {
            Some(n) => n.clone(),
            None => addr
                .rsplit_once(':')
                .map(|(h, _)| h)
                .unwrap_or(addr)
                .trim_matches(['[', ']'])
                .to_string(),
        };
        let name = ServerName::try_from(host.clone())
            .map_err(|e| Error::Tls(format!("server name {host:?}: {e}")))?;
        let s = self
            .connector
            .connect(name, tcp)
            .await
            .map_err(|e| Error::Tls(format!("handshake with {addr}: {e}")))?;
        Ok(Box::new(s))
    }
}
