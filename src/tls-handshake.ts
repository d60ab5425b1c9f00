/**
 * The TLS handshake of TlsSocket (tls.ts), with subtls: loaded on first use, together with subtls,
 * so that bundlers split both out of the driver.
 */
import { ReadQueue, startTls, TrustedCert, type RootCertsDatabase } from 'subtls'

/** SSLRequest: int32 length 8, int32 code 80877103. */
const SSL_REQUEST = new Uint8Array([0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x2f])
const S = 0x53
const N = 0x4e
const E = 0x45

const isIP = (host: string) => /^\d{1,3}(\.\d{1,3}){3}$/.test(host) || host.includes(':')

const databases = new Map<string, Promise<RootCertsDatabase>>()
/** The trusted-roots database for a PEM, built once per PEM. */
export function rootDatabase(pem: string): Promise<RootCertsDatabase> {
  let db = databases.get(pem)
  if (!db) {
    db = (async () => {
      if (!/-----BEGIN CERTIFICATE-----/.test(pem)) throw new Error('rootCerts holds no PEM certificate (-----BEGIN CERTIFICATE-----)')
      return TrustedCert.databaseFromPEM(pem)
    })()
    db.catch(() => databases.delete(pem))
    databases.set(pem, db)
  }
  return db
}

/** What the handshake needs of its socket. */
export interface Channel {
  /** The name to verify (and send as SNI). */
  name: string
  /** `host:port` and the WebSocket URL, for messages. */
  where: string
  url: string
  /** Send the SSLRequest and the ClientHello in one message. */
  pipelined: boolean
  /** The bytes Postgres sent so far. */
  early: Uint8Array[]
  write(data: Uint8Array): void
  /** The WebSocket has closed. */
  closed(): boolean
}

export interface Tls {
  read(): Promise<Uint8Array | undefined>
  write(data: Uint8Array): Promise<void>
}

/**
 * SSLRequest, 'S', then the TLS handshake. Returns the queue the socket's incoming bytes must be
 * fed to at once, and the session once the handshake (and certificate verification) succeeded.
 */
export function handshake(channel: Channel, db: RootCertsDatabase): { queue: ReadQueue; tls: Promise<Tls> } {
  const queue = new (class extends ReadQueue {
    moreDataMayFollow() {
      return !channel.closed()
    }
  })()
  for (const chunk of channel.early) queue.enqueue(chunk)
  const read = (bytes: number, mode?: number) => queue.read(bytes, mode)
  const options: Parameters<typeof startTls>[4] = { useSNI: !isIP(channel.name) }
  const tls = (async () => {
    if (channel.pipelined) {
      options.writePreData = SSL_REQUEST
      options.expectPreData = new Uint8Array([S])
    } else {
      channel.write(SSL_REQUEST)
      const answer = await read(1)
      if (answer?.[0] !== S) throw new Error('Pre data did not match expectation')
    }
    return startTls(channel.name, db, read as any, channel.write, options)
  })().catch((err) => {
    throw explain(channel, err)
  })
  return { queue, tls }
}

/** Turns subtls's terse errors into a message that says what is wrong, keeping it as `cause`. */
function explain({ where, url, early, closed }: Channel, err: Error): Error {
  const msg = err.message
  let reason: string
  if (/^Pre data did not match/.test(msg)) {
    const first = early.length ? early[0][0] : undefined
    if (first === N) {
      return new Error(`edgepg: Postgres at ${where} (via ${url}) does not accept TLS (it answered the SSLRequest with 'N'); enable ssl on the server or connect without TLS`, { cause: err })
    }
    reason =
      first === E ? `Postgres answered the SSLRequest with an error${errorText(early)}`
      : first === undefined ? 'the connection closed before Postgres answered the SSLRequest'
      : `Postgres answered the SSLRequest with byte 0x${first.toString(16)}, not 'S'`
  } else if (/^No matching subjectAltName/.test(msg)) {
    const name = where.replace(/:\d+$/, '')
    reason = `certificate does not match host name "${name}" (no matching DNS subjectAltName)`
    if (isIP(name)) reason += '; subtls verifies DNS names only, so connect by host name'
  } else if (/^End-user certificate is not valid now/.test(msg)) {
    reason = 'certificate has expired or is not yet valid'
  } else if (/^Signing certificate is not valid now/.test(msg)) {
    reason = 'a CA certificate in the chain has expired or is not yet valid'
  } else if (/trusted root/.test(msg)) {
    reason = 'certificate is not trusted (unknown CA: it does not chain to any certificate in rootCerts)'
  } else if (/no TLS server extKeyUsage/.test(msg)) {
    reason = 'certificate is not for TLS servers (no serverAuth extended key usage)'
  } else if (/keyUsage does not include digital signatures/.test(msg)) {
    reason = 'a CA certificate in the chain lacks digitalSignature in its keyUsage (subtls requires it)'
  } else if (/basicConstraints do not indicate a CA/.test(msg)) {
    reason = 'certificate is signed by a certificate that is not a CA'
  } else if (/certificate verify failed|Invalid server verify hash/.test(msg)) {
    reason = `a signature in the handshake did not verify (${msg})`
  } else if (/Fatal alert|HelloRetryRequest|Unsupported|Unexpected TLS record type/.test(msg)) {
    reason = `Postgres and subtls could not agree on TLS parameters (${msg}); subtls needs TLS 1.3 with TLS_AES_128_GCM_SHA256, P-256 key exchange, and an ECDSA P-256 or RSA-PSS server certificate`
  } else if (closed() || /Not enough data/.test(msg)) {
    reason = `the connection closed during the TLS handshake (${msg})`
  } else {
    reason = msg
  }
  return new Error(`edgepg: TLS to Postgres at ${where} (via ${url}) failed: ${reason}`, { cause: err })
}

/** The M field of an ErrorResponse among the early bytes, if complete. */
function errorText(early: Uint8Array[]): string {
  const bytes = new Uint8Array(early.reduce((n, c) => n + c.length, 0))
  early.reduce((at, c) => (bytes.set(c, at), at + c.length), 0)
  const end = Math.min(bytes.length, 1 + (bytes.length >= 5 ? new DataView(bytes.buffer).getInt32(1) : 0))
  for (let i = 5; i < end; ) {
    const stop = bytes.indexOf(0, i + 1)
    if (stop < 0 || stop > end) break
    if (bytes[i] === 0x4d) return `: ${new TextDecoder().decode(bytes.subarray(i + 1, stop))}`
    i = stop + 1
  }
  return ''
}
