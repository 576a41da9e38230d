//! Any `:authority` on a unix socket.
//!
//! gRPC clients dialing a unix socket put something else than a host in the
//! HTTP/2 `:authority` pseudo-header: gRPC C-core and older grpc-go send the
//! socket path (`/var/lib/kubelet/device-plugins/nvidia-gpu.sock`), grpc-go
//! now sends `localhost`. The HTTP/2 server under tonic (`h2`) parses the
//! authority as a URI authority and resets every stream whose authority does
//! not parse (`PROTOCOL_ERROR`, "malformed authority"), before any handler
//! runs. A server on a unix socket has no use for the authority, so
//! [`AnyAuthority`] sits between the socket and the server and rewrites the
//! client's header blocks on the way in: an `:authority` that is not a valid
//! URI authority becomes `localhost`; every other byte is passed through.
//!
//! Header blocks are HPACK-compressed against a table the client's encoder
//! keeps, so the rewriter decodes every block the client sends (keeping that
//! table in step) and encodes it again with literals only, so the server's
//! decoder table never holds anything: the two stay consistent whatever the
//! client indexes. Connections that do not start with the HTTP/2 preface are
//! passed through untouched.
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// The HTTP/2 client connection preface.
pub const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// What a malformed `:authority` becomes.
pub const REPLACEMENT_AUTHORITY: &str = "localhost";
/// The largest header block (all its frames together) the rewriter holds.
pub const MAX_HEADER_BLOCK: usize = 1 << 20;
/// Frame payloads the rewriter writes stay within the smallest
/// `SETTINGS_MAX_FRAME_SIZE` a server may announce.
const MAX_FRAME: usize = 16_384;
/// The largest dynamic table a client may ask the rewriter's decoder for.
const MAX_TABLE: usize = 65_536;

const HEADERS: u8 = 0x1;
const CONTINUATION: u8 = 0x9;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;

/// Why a connection's input cannot be rewritten (the connection is closed,
/// as the server would close it for the same input).
#[derive(Debug, thiserror::Error)]
pub enum RewriteError {
    /// A header block does not decode.
    #[error("malformed HTTP/2 header block from the client: {0}")]
    Hpack(String),
    /// The frames break HTTP/2's rules for header blocks.
    #[error("HTTP/2 protocol error from the client: {0}")]
    Protocol(&'static str),
    /// A header block is larger than [`MAX_HEADER_BLOCK`].
    #[error("HTTP/2 header block larger than {MAX_HEADER_BLOCK} bytes from the client")]
    TooLarge,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// This many bytes of the preface seen.
    Preface(usize),
    /// At a frame header.
    Frames,
    /// This many bytes of a passed-through frame's payload still to come.
    Payload(usize),
    /// Not HTTP/2 with prior knowledge: everything passes through.
    Raw,
}

struct Block {
    stream: u32,
    end_stream: bool,
    priority: Option<[u8; 5]>,
    fragment: Vec<u8>,
}

/// The rewriting of one connection's client-to-server bytes, as a pure
/// state machine: [`AuthorityRewriter::feed`] takes bytes as they arrive,
/// split anywhere, and appends what the server should read.
pub struct AuthorityRewriter {
    state: State,
    pending: Vec<u8>,
    decoder: loona_hpack::Decoder<'static>,
    block: Option<Block>,
}

impl Default for AuthorityRewriter {
    fn default() -> Self {
        let mut decoder = loona_hpack::Decoder::new();
        decoder.set_max_allowed_table_size(MAX_TABLE);
        AuthorityRewriter {
            state: State::Preface(0),
            pending: Vec::new(),
            decoder,
            block: None,
        }
    }
}

impl AuthorityRewriter {
    /// A rewriter at the start of a connection.
    pub fn new() -> Self {
        Self::default()
    }

    /// Takes the next bytes from the client; appends to `out` what the
    /// server should read next (bytes of an unfinished frame header or
    /// header block are held until the rest arrives).
    pub fn feed(&mut self, input: &[u8], out: &mut Vec<u8>) -> Result<(), RewriteError> {
        self.pending.extend_from_slice(input);
        let mut pos = 0;
        let result = self.step(&mut pos, out);
        self.pending.drain(..pos);
        result
    }

    fn step(&mut self, pos: &mut usize, out: &mut Vec<u8>) -> Result<(), RewriteError> {
        loop {
            let avail = self.pending.len() - *pos;
            match self.state {
                State::Raw => {
                    out.extend_from_slice(&self.pending[*pos..]);
                    *pos = self.pending.len();
                    return Ok(());
                }
                State::Preface(seen) => {
                    let n = avail.min(PREFACE.len() - seen);
                    if self.pending[*pos..*pos + n] != PREFACE[seen..seen + n] {
                        self.state = State::Raw;
                        continue;
                    }
                    out.extend_from_slice(&self.pending[*pos..*pos + n]);
                    *pos += n;
                    if seen + n < PREFACE.len() {
                        self.state = State::Preface(seen + n);
                        return Ok(());
                    }
                    self.state = State::Frames;
                }
                State::Payload(left) => {
                    let n = avail.min(left);
                    out.extend_from_slice(&self.pending[*pos..*pos + n]);
                    *pos += n;
                    if n < left {
                        self.state = State::Payload(left - n);
                        return Ok(());
                    }
                    self.state = State::Frames;
                }
                State::Frames => {
                    if avail < 9 {
                        return Ok(());
                    }
                    let h = &self.pending[*pos..*pos + 9];
                    let length =
                        (usize::from(h[0]) << 16) | (usize::from(h[1]) << 8) | usize::from(h[2]);
                    let (kind, flags) = (h[3], h[4]);
                    let stream = u32::from_be_bytes([h[5], h[6], h[7], h[8]]) & 0x7fff_ffff;
                    if kind != HEADERS && kind != CONTINUATION {
                        if self.block.is_some() {
                            return Err(RewriteError::Protocol(
                                "a header block was interrupted by another frame",
                            ));
                        }
                        out.extend_from_slice(h);
                        *pos += 9;
                        self.state = State::Payload(length);
                        continue;
                    }
                    if length > MAX_HEADER_BLOCK {
                        return Err(RewriteError::TooLarge);
                    }
                    if avail < 9 + length {
                        return Ok(());
                    }
                    let payload = self.pending[*pos + 9..*pos + 9 + length].to_vec();
                    *pos += 9 + length;
                    self.header_frame(kind, flags, stream, &payload, out)?;
                }
            }
        }
    }

    fn header_frame(
        &mut self,
        kind: u8,
        flags: u8,
        stream: u32,
        payload: &[u8],
        out: &mut Vec<u8>,
    ) -> Result<(), RewriteError> {
        if kind == HEADERS {
            if self.block.is_some() {
                return Err(RewriteError::Protocol(
                    "a HEADERS frame arrived inside another header block",
                ));
            }
            let mut p = payload;
            let mut padding = 0;
            if flags & PADDED != 0 {
                let (&n, rest) = p
                    .split_first()
                    .ok_or(RewriteError::Protocol("a padded HEADERS frame is empty"))?;
                padding = usize::from(n);
                p = rest;
            }
            let mut priority = None;
            if flags & PRIORITY != 0 {
                let (head, rest) = p
                    .split_first_chunk::<5>()
                    .ok_or(RewriteError::Protocol("a HEADERS frame lacks its priority"))?;
                priority = Some(*head);
                p = rest;
            }
            if padding > p.len() {
                return Err(RewriteError::Protocol(
                    "a HEADERS frame has more padding than payload",
                ));
            }
            self.block = Some(Block {
                stream,
                end_stream: flags & END_STREAM != 0,
                priority,
                fragment: p[..p.len() - padding].to_vec(),
            });
        } else {
            let block = self.block.as_mut().ok_or(RewriteError::Protocol(
                "a CONTINUATION frame arrived outside a header block",
            ))?;
            if block.stream != stream {
                return Err(RewriteError::Protocol(
                    "a CONTINUATION frame is for another stream",
                ));
            }
            if block.fragment.len() + payload.len() > MAX_HEADER_BLOCK {
                return Err(RewriteError::TooLarge);
            }
            block.fragment.extend_from_slice(payload);
        }
        if flags & END_HEADERS != 0
            && let Some(block) = self.block.take()
        {
            self.finish(block, out)?;
        }
        Ok(())
    }

    fn finish(&mut self, block: Block, out: &mut Vec<u8>) -> Result<(), RewriteError> {
        let mut fields: Vec<(Vec<u8>, Vec<u8>)> = Vec::new();
        self.decoder
            .decode_with_cb(&block.fragment, |name, value| {
                fields.push((name.into_owned(), value.into_owned()));
            })
            .map_err(|e| RewriteError::Hpack(format!("{e:?}")))?;
        for (name, value) in &mut fields {
            if name.as_slice() == b":authority"
                && http::uri::Authority::try_from(value.as_slice()).is_err()
            {
                *value = REPLACEMENT_AUTHORITY.as_bytes().to_vec();
            }
        }
        let mut encoded = Vec::with_capacity(block.fragment.len() + 64);
        for (name, value) in &fields {
            encode_literal(name, value, &mut encoded);
        }
        write_header_frames(&block, &encoded, out);
        Ok(())
    }
}

/// HPACK integer with an `n`-bit prefix whose high bits are `first`.
fn encode_integer(value: usize, n: u8, first: u8, out: &mut Vec<u8>) {
    let max = (1usize << n) - 1;
    if value < max {
        // Fits the prefix (less than 2^n - 1, so below 255).
        out.push(first | value as u8);
        return;
    }
    out.push(first | max as u8);
    let mut rest = value - max;
    while rest >= 128 {
        out.push((rest % 128) as u8 | 0x80);
        rest /= 128;
    }
    out.push(rest as u8);
}

/// A literal header field without indexing, with a literal name: nothing
/// enters the server's dynamic table.
fn encode_literal(name: &[u8], value: &[u8], out: &mut Vec<u8>) {
    out.push(0x00);
    for s in [name, value] {
        encode_integer(s.len(), 7, 0x00, out);
        out.extend_from_slice(s);
    }
}

fn frame_header(length: usize, kind: u8, flags: u8, stream: u32, out: &mut Vec<u8>) {
    // Frames written here are at most MAX_FRAME bytes long.
    out.extend_from_slice(&[
        (length >> 16) as u8,
        (length >> 8) as u8,
        length as u8,
        kind,
        flags,
    ]);
    out.extend_from_slice(&stream.to_be_bytes());
}

/// The block as a HEADERS frame (end-of-stream and priority as received,
/// no padding) and as many CONTINUATION frames as it needs.
fn write_header_frames(block: &Block, encoded: &[u8], out: &mut Vec<u8>) {
    let prio_len = if block.priority.is_some() { 5 } else { 0 };
    let first_len = encoded.len().min(MAX_FRAME - prio_len);
    let (first, mut rest) = encoded.split_at(first_len);
    let mut flags = if block.end_stream { END_STREAM } else { 0 };
    if block.priority.is_some() {
        flags |= PRIORITY;
    }
    if rest.is_empty() {
        flags |= END_HEADERS;
    }
    frame_header(prio_len + first.len(), HEADERS, flags, block.stream, out);
    if let Some(p) = &block.priority {
        out.extend_from_slice(p);
    }
    out.extend_from_slice(first);
    while !rest.is_empty() {
        let (chunk, tail) = rest.split_at(rest.len().min(MAX_FRAME));
        let flags = if tail.is_empty() { END_HEADERS } else { 0 };
        frame_header(chunk.len(), CONTINUATION, flags, block.stream, out);
        out.extend_from_slice(chunk);
        rest = tail;
    }
}

/// A connection whose incoming bytes go through an [`AuthorityRewriter`];
/// writes pass straight through.
pub struct AnyAuthority<S> {
    inner: S,
    rewriter: AuthorityRewriter,
    out: Vec<u8>,
    out_pos: usize,
    eof: bool,
}

impl<S> AnyAuthority<S> {
    /// Wraps a freshly accepted connection.
    pub fn new(inner: S) -> Self {
        AnyAuthority {
            inner,
            rewriter: AuthorityRewriter::new(),
            out: Vec::new(),
            out_pos: 0,
            eof: false,
        }
    }

    /// The wrapped connection.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for AnyAuthority<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            if this.out_pos < this.out.len() {
                let n = buf.remaining().min(this.out.len() - this.out_pos);
                buf.put_slice(&this.out[this.out_pos..this.out_pos + n]);
                this.out_pos += n;
                if this.out_pos == this.out.len() {
                    this.out.clear();
                    this.out_pos = 0;
                }
                return Poll::Ready(Ok(()));
            }
            if this.eof {
                return Poll::Ready(Ok(()));
            }
            let mut chunk = [0u8; 8192];
            let mut read = ReadBuf::new(&mut chunk);
            ready!(Pin::new(&mut this.inner).poll_read(cx, &mut read))?;
            if read.filled().is_empty() {
                this.eof = true;
                continue;
            }
            this.rewriter
                .feed(read.filled(), &mut this.out)
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for AnyAuthority<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

impl<S: tonic::transport::server::Connected> tonic::transport::server::Connected
    for AnyAuthority<S>
{
    type ConnectInfo = S::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        frame_header(payload.len(), kind, flags, stream, &mut out);
        out.extend_from_slice(payload);
        out
    }

    /// `:authority` with incremental indexing (static name 1), then the
    /// request's other fields, as a gRPC C-core client encodes them.
    fn first_block(authority: &str) -> Vec<u8> {
        let mut b = vec![0x41];
        encode_integer(authority.len(), 7, 0, &mut b);
        b.extend_from_slice(authority.as_bytes());
        b.extend_from_slice(&[0x83, 0x86]); // :method POST, :scheme http
        b.push(0x44); // :path, indexed name, incremental indexing
        let path = b"/v1beta1.Registration/Register";
        encode_integer(path.len(), 7, 0, &mut b);
        b.extend_from_slice(path);
        b
    }

    /// The same request again from the dynamic table: 63 is `:authority`, 62 `:path`.
    const SECOND_BLOCK: [u8; 4] = [0x80 | 63, 0x83, 0x86, 0x80 | 62];

    /// Decodes the server's view of a connection: every header block.
    fn server_view(bytes: &[u8]) -> Vec<(u32, Vec<(String, String)>)> {
        assert!(bytes.starts_with(PREFACE));
        let mut d = loona_hpack::Decoder::new();
        let mut pos = PREFACE.len();
        let mut blocks = Vec::new();
        let mut open: Option<(u32, Vec<u8>)> = None;
        while pos < bytes.len() {
            let h = &bytes[pos..pos + 9];
            let len = (usize::from(h[0]) << 16) | (usize::from(h[1]) << 8) | usize::from(h[2]);
            let stream = u32::from_be_bytes([h[5], h[6], h[7], h[8]]);
            let mut payload = &bytes[pos + 9..pos + 9 + len];
            if h[3] == HEADERS && h[4] & PRIORITY != 0 {
                payload = &payload[5..];
            }
            if h[3] == HEADERS || h[3] == CONTINUATION {
                assert_eq!(h[4] & PADDED, 0, "no padding is written");
                let (_, frag) = open.get_or_insert_with(|| (stream, Vec::new()));
                frag.extend_from_slice(payload);
                if h[4] & END_HEADERS != 0 {
                    let (s, frag) = open.take().unwrap();
                    let fields = d
                        .decode(&frag)
                        .unwrap()
                        .into_iter()
                        .map(|(n, v)| {
                            (String::from_utf8(n).unwrap(), String::from_utf8(v).unwrap())
                        })
                        .collect();
                    blocks.push((s, fields));
                }
            }
            pos += 9 + len;
        }
        blocks
    }

    fn connection(authority: &str) -> Vec<u8> {
        let mut input = PREFACE.to_vec();
        input.extend(frame(0x4, 0, 0, &[])); // SETTINGS
        input.extend(frame(HEADERS, END_HEADERS, 1, &first_block(authority)));
        input.extend(frame(0x0, END_STREAM, 1, &[0, 0, 0, 0, 0])); // DATA
        // Padded, with priority, split over a CONTINUATION.
        let mut padded = vec![3];
        padded.extend_from_slice(&[0, 0, 0, 0, 15]);
        padded.extend_from_slice(&SECOND_BLOCK[..2]);
        padded.extend_from_slice(&[0, 0, 0]);
        input.extend(frame(HEADERS, PADDED | PRIORITY, 3, &padded));
        input.extend(frame(CONTINUATION, END_HEADERS, 3, &SECOND_BLOCK[2..]));
        input.extend(frame(0x0, END_STREAM, 3, &[0, 0, 0, 0, 0]));
        input
    }

    fn rewrite_in_chunks(input: &[u8], cuts: &[usize]) -> Vec<u8> {
        let mut r = AuthorityRewriter::new();
        let mut out = Vec::new();
        let mut last = 0;
        let mut cuts: Vec<usize> = cuts.iter().map(|c| c % (input.len() + 1)).collect();
        cuts.sort_unstable();
        for c in cuts.into_iter().chain([input.len()]) {
            r.feed(&input[last..c], &mut out).unwrap();
            last = c;
        }
        out
    }

    #[test]
    fn a_socket_path_authority_becomes_localhost_in_every_request() {
        // The raw path (gRPC C-core, older grpc-go) and the percent-encoded
        // one (newer grpc-go without a `unix:` target) are both refused by h2.
        for authority in [
            "/var/lib/kubelet/device-plugins/nvidia-gpu.sock",
            "%2Fvar%2Flib%2Fkubelet%2Fdevice-plugins%2Fkubelet.sock",
        ] {
            assert!(http::uri::Authority::try_from(authority).is_err());
            let blocks = server_view(&rewrite_in_chunks(&connection(authority), &[]));
            assert_eq!(blocks[1].1[0].1, "localhost", "{authority}");
        }
        let out = rewrite_in_chunks(
            &connection("/var/lib/kubelet/device-plugins/nvidia-gpu.sock"),
            &[],
        );
        let blocks = server_view(&out);
        assert_eq!(blocks.len(), 2);
        for (stream, fields) in &blocks {
            assert_eq!(
                fields[0],
                (":authority".into(), "localhost".into()),
                "stream {stream}"
            );
            assert_eq!(
                fields[3],
                (":path".into(), "/v1beta1.Registration/Register".into())
            );
        }
        assert_eq!(blocks[1].0, 3);
    }

    #[test]
    fn a_valid_authority_is_kept() {
        for authority in ["localhost", "localhost:50051", "127.0.0.1:10250"] {
            let blocks = server_view(&rewrite_in_chunks(&connection(authority), &[]));
            assert_eq!(blocks[1].1[0].1, authority);
        }
    }

    #[test]
    fn other_protocols_pass_through() {
        let http1 = b"GET / HTTP/1.1\r\nHost: /tmp/x.sock\r\n\r\n";
        assert_eq!(rewrite_in_chunks(http1, &[3, 7]), http1);
    }

    #[test]
    fn broken_blocks_are_refused() {
        let mut r = AuthorityRewriter::new();
        let mut out = Vec::new();
        let mut input = PREFACE.to_vec();
        input.extend(frame(HEADERS, 0, 1, &first_block("x")));
        input.extend(frame(0x0, 0, 1, &[]));
        assert!(matches!(
            r.feed(&input, &mut out),
            Err(RewriteError::Protocol(_))
        ));
        let mut r = AuthorityRewriter::new();
        let mut input = PREFACE.to_vec();
        input.extend(frame(HEADERS, END_HEADERS, 1, &[0x80 | 70]));
        assert!(matches!(
            r.feed(&input, &mut out),
            Err(RewriteError::Hpack(_))
        ));
    }

    #[test]
    fn long_blocks_are_split_into_frames_the_server_accepts() {
        let big = "x".repeat(40_000);
        let mut block = first_block("/tmp/a.sock");
        block.push(0x40);
        encode_integer(3, 7, 0, &mut block);
        block.extend_from_slice(b"big");
        encode_integer(big.len(), 7, 0, &mut block);
        block.extend_from_slice(big.as_bytes());
        let mut input = PREFACE.to_vec();
        input.extend(frame(HEADERS, END_HEADERS | END_STREAM, 1, &block));
        let out = rewrite_in_chunks(&input, &[]);
        let blocks = server_view(&out);
        assert_eq!(blocks[0].1.last().unwrap().1, big);
        let mut pos = PREFACE.len();
        while pos < out.len() {
            let len = (usize::from(out[pos]) << 16)
                | (usize::from(out[pos + 1]) << 8)
                | usize::from(out[pos + 2]);
            assert!(len <= MAX_FRAME);
            pos += 9 + len;
        }
    }

    proptest! {
        /// However the client's bytes are split, the server reads the same.
        #[test]
        fn output_does_not_depend_on_how_input_arrives(
            cuts in proptest::collection::vec(0usize..400, 0..12),
        ) {
            let input = connection("/var/lib/kubelet/device-plugins/nvidia-gpu.sock");
            prop_assert_eq!(rewrite_in_chunks(&input, &cuts), rewrite_in_chunks(&input, &[]));
        }

        /// HPACK integers round-trip through the decoder for every value.
        #[test]
        fn literals_decode_to_what_was_encoded(
            name in "[a-z-]{1,20}",
            value in proptest::collection::vec(any::<u8>(), 0..400),
        ) {
            let mut b = Vec::new();
            encode_literal(name.as_bytes(), &value, &mut b);
            let decoded = loona_hpack::Decoder::new().decode(&b).unwrap();
            prop_assert_eq!(decoded, vec![(name.into_bytes(), value)]);
        }
    }
}
