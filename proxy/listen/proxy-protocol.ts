/**
 * The PROXY protocol (HAProxy's, v1 text and v2 binary): a load balancer that speaks it sends, ahead
 * of the client's bytes, the address the client connected from. Only the source address is kept.
 */
const V2_SIGNATURE = Buffer.from([0x0d, 0x0a, 0x0d, 0x0a, 0x00, 0x0d, 0x0a, 0x51, 0x55, 0x49, 0x54, 0x0a])
const V1_PREFIX = Buffer.from('PROXY ')
/** The first 12 bytes of an IPv4-mapped IPv6 address (::ffff:0:0/96). */
const V4_MAPPED = Buffer.from([0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff])
/** A v1 header's longest form (the spec's 107 bytes, CRLF included). */
const V1_MAX = 107

export class ProxyProtocolError extends Error {}

export type ProxyHeader =
  /** Not (yet) known: `bytes` may still grow into a header. */
  | { kind: 'more' }
  /** No PROXY header: the client's bytes start at once. */
  | { kind: 'none' }
  /** A header of `length` bytes; `address` the client's (undefined: LOCAL or UNKNOWN, the balancer's own connection). */
  | { kind: 'header'; length: number; address?: string }

/** Reads a PROXY header at the start of `bytes`; throws ProxyProtocolError for a malformed one. */
export function readProxyHeader(bytes: Buffer): ProxyHeader {
  if (startsLike(bytes, V2_SIGNATURE)) return bytes.length < V2_SIGNATURE.length + 4 ? { kind: 'more' } : readV2(bytes)
  if (startsLike(bytes, V1_PREFIX)) return bytes.length < V1_PREFIX.length ? { kind: 'more' } : readV1(bytes)
  return { kind: 'none' }
}

/** Whether `bytes` is `prefix`, or its start so far. */
const startsLike = (bytes: Buffer, prefix: Buffer) => bytes.subarray(0, prefix.length).equals(prefix.subarray(0, Math.min(bytes.length, prefix.length)))

function readV1(bytes: Buffer): ProxyHeader {
  const end = bytes.indexOf('\r\n')
  if (end < 0) {
    if (bytes.length >= V1_MAX) throw new ProxyProtocolError('PROXY v1 header without its CRLF')
    return { kind: 'more' }
  }
  const [, family, source] = bytes.toString('latin1', 0, end).split(' ')
  if (family === 'UNKNOWN') return { kind: 'header', length: end + 2 }
  if ((family !== 'TCP4' && family !== 'TCP6') || !source) throw new ProxyProtocolError(`malformed PROXY v1 header (family ${family})`)
  return { kind: 'header', length: end + 2, address: source }
}

function readV2(bytes: Buffer): ProxyHeader {
  const at = V2_SIGNATURE.length
  const versionCommand = bytes[at]
  const family = bytes[at + 1]
  const length = at + 4 + bytes.readUInt16BE(at + 2)
  if (versionCommand >> 4 !== 2) throw new ProxyProtocolError(`PROXY v2 header of version ${versionCommand >> 4}`)
  if (bytes.length < length) return { kind: 'more' }
  const command = versionCommand & 0x0f
  if (command === 0) return { kind: 'header', length } // LOCAL: the balancer's own (a health check)
  if (command !== 1) throw new ProxyProtocolError(`PROXY v2 header with command ${command}`)
  const body = at + 4
  if (family >> 4 === 1 && length >= body + 12) return { kind: 'header', length, address: [...bytes.subarray(body, body + 4)].join('.') }
  if (family >> 4 === 2 && length >= body + 36) {
    // An IPv4 client of a dual-stack balancer (::ffff:a.b.c.d) is an IPv4 client: counted as itself, not by the /64 all of them share.
    if (bytes.subarray(body, body + 12).equals(V4_MAPPED)) return { kind: 'header', length, address: [...bytes.subarray(body + 12, body + 16)].join('.') }
    const groups = Array.from({ length: 8 }, (_, i) => bytes.readUInt16BE(body + 2 * i).toString(16))
    return { kind: 'header', length, address: groups.join(':') }
  }
  return { kind: 'header', length } // AF_UNSPEC / AF_UNIX: no address to take
}
