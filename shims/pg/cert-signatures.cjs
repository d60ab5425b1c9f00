// Stands in for pg/lib/crypto/cert-signatures, which pg reads only for SCRAM-SHA-256-PLUS channel
// binding, and only on a stream with getPeerCertificate(): edgepg's sockets have none, so pg picks
// plain SCRAM-SHA-256 (channel binding to Postgres' certificate needs the TLS session, which
// subtls keeps to itself).
exports.signatureAlgorithmHashFromCertificate = () => {
  throw new Error('edgepg: SCRAM-SHA-256-PLUS (channel binding) is not available')
}
