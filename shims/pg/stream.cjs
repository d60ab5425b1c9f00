// Stands in for pg/lib/stream (TCP and TLS sockets from net/tls or cloudflare:sockets): edgepg
// always hands pg its own stream, and pg never negotiates TLS itself (TlsSocket does, inside it).
const unavailable = () => {
  throw new Error('edgepg: pg opens no sockets of its own here; connections go over WebSockets')
}
module.exports = { getStream: unavailable, getSecureStream: unavailable }
