//! The real node's forwarders (`xtask node-proxy`), one process each, started
//! in the namespace whose sockets it must open:
//! - `--listen-unix P --to-tcp A` (host): the node reaches the API server.
//! - `--listen-tcp A... --to-unix P` (node): the kubelet and pods connect to
//!   the API server's addresses inside the node.
//! - `--connect-unix P --allow CIDR` (node): an HTTP CONNECT proxy, the API
//!   server's egress selector into the node; targets outside CIDR are refused,
//!   so no connection of the API server ever leaves the machine.
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Ipv4Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail};

/// Flags of `xtask node-proxy`.
#[derive(clap::Args, Clone, Debug)]
pub struct ProxyArgs {
    /// TCP addresses to accept on (with --to-unix).
    #[arg(long)]
    listen_tcp: Vec<SocketAddr>,
    /// Unix socket to forward to (with --listen-tcp).
    #[arg(long)]
    to_unix: Option<PathBuf>,
    /// Unix socket to accept on (with --to-tcp).
    #[arg(long)]
    listen_unix: Option<PathBuf>,
    /// TCP address to forward to (with --listen-unix).
    #[arg(long)]
    to_tcp: Option<SocketAddr>,
    /// Unix socket of an HTTP CONNECT proxy (with --allow).
    #[arg(long)]
    connect_unix: Option<PathBuf>,
    /// The only IPv4 network CONNECT may reach, as a.b.c.d/len.
    #[arg(long)]
    allow: Option<String>,
}

/// Either end of a forwarded connection.
enum Stream {
    Tcp(TcpStream),
    Unix(UnixStream),
}

/// A connection split for copying: a reader, a writer, and a handle to
/// close its write side.
type Halves = (Box<dyn Read + Send>, Box<dyn Write + Send>, Stream);

impl Stream {
    fn split(&self) -> Result<Halves> {
        Ok(match self {
            Stream::Tcp(s) => (
                Box::new(s.try_clone()?),
                Box::new(s.try_clone()?),
                Stream::Tcp(s.try_clone()?),
            ),
            Stream::Unix(s) => (
                Box::new(s.try_clone()?),
                Box::new(s.try_clone()?),
                Stream::Unix(s.try_clone()?),
            ),
        })
    }

    fn shutdown_write(&self) {
        let _ = match self {
            Stream::Tcp(s) => s.shutdown(Shutdown::Write),
            Stream::Unix(s) => s.shutdown(Shutdown::Write),
        };
    }
}

/// Copies both ways until each side has closed.
fn pipe(a: Stream, b: Stream) -> Result<()> {
    let (mut a_read, mut a_write, a_close) = a.split()?;
    let (mut b_read, mut b_write, b_close) = b.split()?;
    let forward = std::thread::spawn(move || {
        let _ = std::io::copy(&mut a_read, &mut b_write);
        b_close.shutdown_write();
    });
    let _ = std::io::copy(&mut b_read, &mut a_write);
    a_close.shutdown_write();
    let _ = forward.join();
    Ok(())
}

fn unix_listener(path: &Path) -> Result<UnixListener> {
    let _ = std::fs::remove_file(path);
    UnixListener::bind(path).with_context(|| format!("listening on {}", path.display()))
}

/// Runs the proxy the flags describe until killed.
pub fn run(args: &ProxyArgs) -> Result<()> {
    if let (Some(listen), Some(to)) = (&args.listen_unix, args.to_tcp) {
        let listener = unix_listener(listen)?;
        for conn in listener.incoming() {
            let Ok(conn) = conn else { continue };
            std::thread::spawn(move || {
                if let Ok(up) = TcpStream::connect_timeout(&to, Duration::from_secs(5)) {
                    let _ = pipe(Stream::Unix(conn), Stream::Tcp(up));
                }
            });
        }
        return Ok(());
    }
    if let Some(to) = &args.to_unix {
        if args.listen_tcp.is_empty() {
            bail!("--to-unix needs at least one --listen-tcp");
        }
        let mut threads = Vec::new();
        for addr in &args.listen_tcp {
            let listener =
                TcpListener::bind(addr).with_context(|| format!("listening on {addr}"))?;
            let to = to.clone();
            threads.push(std::thread::spawn(move || {
                for conn in listener.incoming() {
                    let Ok(conn) = conn else { continue };
                    let to = to.clone();
                    std::thread::spawn(move || {
                        if let Ok(up) = UnixStream::connect(&to) {
                            let _ = pipe(Stream::Tcp(conn), Stream::Unix(up));
                        }
                    });
                }
            }));
        }
        for t in threads {
            let _ = t.join();
        }
        return Ok(());
    }
    if let (Some(listen), Some(allow)) = (&args.connect_unix, &args.allow) {
        let allow = Cidr::parse(allow)?;
        let listener = unix_listener(listen)?;
        for conn in listener.incoming() {
            let Ok(conn) = conn else { continue };
            std::thread::spawn(move || {
                if let Err(err) = serve_connect(conn, allow) {
                    eprintln!("node-proxy: CONNECT refused: {err:#}");
                }
            });
        }
        return Ok(());
    }
    bail!(
        "node-proxy needs --listen-unix with --to-tcp, --listen-tcp with --to-unix, \
         or --connect-unix with --allow"
    )
}

/// An IPv4 network.
#[derive(Clone, Copy, Debug)]
struct Cidr {
    net: u32,
    mask: u32,
}

impl Cidr {
    fn parse(text: &str) -> Result<Self> {
        let (addr, len) = text
            .split_once('/')
            .with_context(|| format!("{text:?} is not a.b.c.d/len"))?;
        let addr: Ipv4Addr = addr
            .parse()
            .with_context(|| format!("address in {text:?}"))?;
        let len: u32 = len
            .parse()
            .with_context(|| format!("prefix length in {text:?}"))?;
        if len > 32 {
            bail!("prefix length {len} in {text:?} is above 32");
        }
        let mask = if len == 0 { 0 } else { u32::MAX << (32 - len) };
        Ok(Self {
            net: u32::from(addr) & mask,
            mask,
        })
    }

    fn contains(&self, addr: Ipv4Addr) -> bool {
        u32::from(addr) & self.mask == self.net
    }
}

/// One CONNECT request: `CONNECT a.b.c.d:port HTTP/1.1`, headers, blank line.
fn serve_connect(conn: UnixStream, allow: Cidr) -> Result<()> {
    let mut reader = BufReader::new(conn.try_clone()?);
    let mut request = String::new();
    reader.read_line(&mut request)?;
    loop {
        let mut header = String::new();
        if reader.read_line(&mut header)? == 0 || header == "\r\n" || header == "\n" {
            break;
        }
    }
    let mut conn_w = conn.try_clone()?;
    let target = parse_connect(&request, allow);
    let target = match target {
        Ok(t) => t,
        Err(err) => {
            let _ = write!(conn_w, "HTTP/1.1 403 Forbidden\r\n\r\n");
            return Err(err);
        }
    };
    let up = match TcpStream::connect_timeout(&target, Duration::from_secs(5)) {
        Ok(up) => up,
        Err(err) => {
            let _ = write!(conn_w, "HTTP/1.1 502 Bad Gateway\r\n\r\n");
            return Err(err).with_context(|| format!("connecting to {target}"));
        }
    };
    write!(conn_w, "HTTP/1.1 200 Connection established\r\n\r\n")?;
    // Bytes the client sent after the request head are already buffered.
    let buffered = reader.buffer().to_vec();
    if !buffered.is_empty() {
        (&up).write_all(&buffered)?;
    }
    pipe(Stream::Unix(conn), Stream::Tcp(up))
}

fn parse_connect(request: &str, allow: Cidr) -> Result<SocketAddr> {
    let mut parts = request.split_whitespace();
    if parts.next() != Some("CONNECT") {
        bail!("not a CONNECT request: {:.80}", request.trim());
    }
    let target = parts.next().context("CONNECT without a target")?;
    let addr: SocketAddr = target
        .parse()
        .with_context(|| format!("CONNECT target {target:.80} is not ip:port"))?;
    match addr {
        SocketAddr::V4(v4) if allow.contains(*v4.ip()) => Ok(addr),
        _ => bail!("CONNECT target {addr} is outside the node's network"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connect_reaches_only_the_allowed_network() {
        let allow = Cidr::parse("10.250.0.0/24").unwrap();
        assert!(parse_connect("CONNECT 10.250.0.1:10250 HTTP/1.1\r\n", allow).is_ok());
        for refused in [
            "CONNECT 10.63.0.1:10250 HTTP/1.1\r\n",
            "CONNECT node-name:10250 HTTP/1.1\r\n",
            "CONNECT [::1]:10250 HTTP/1.1\r\n",
            "GET / HTTP/1.1\r\n",
        ] {
            assert!(parse_connect(refused, allow).is_err(), "{refused}");
        }
    }

    #[test]
    fn cidr_rejects_bad_lengths() {
        assert!(Cidr::parse("10.0.0.0/33").is_err());
        assert!(Cidr::parse("10.0.0.0").is_err());
        assert!(
            Cidr::parse("0.0.0.0/0")
                .unwrap()
                .contains(Ipv4Addr::new(1, 2, 3, 4))
        );
    }
}
