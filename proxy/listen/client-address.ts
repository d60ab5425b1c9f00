/**
 * Who a client is when a load balancer stands in front (`--trust-proxy`): the address a trusted
 * peer declares, with the PROXY protocol or in X-Forwarded-For; never what an untrusted peer says.
 */
import net, { BlockList, type Socket } from 'node:net'
import type { IncomingMessage } from 'node:http'
import { ProxyProtocolError, readProxyHeader } from './proxy-protocol'

/** Addresses as one form: IPv4-mapped IPv6 (::ffff:a.b.c.d, or in hex) as IPv4. */
export function plainAddress(address: string): string {
  const mapped = /^(?:0{0,4}:){1,5}ffff:(?:(\d+\.\d+\.\d+\.\d+)|([\da-f]{1,4}):([\da-f]{1,4}))$/i.exec(address)
  if (!mapped || !net.isIPv6(address)) return address
  if (mapped[1]) return mapped[1]
  const [high, low] = [parseInt(mapped[2], 16), parseInt(mapped[3], 16)]
  return [high >> 8, high & 0xff, low >> 8, low & 0xff].join('.')
}

const LOOPBACK = new BlockList()
LOOPBACK.addSubnet('127.0.0.0', 8, 'ipv4')
LOOPBACK.addAddress('::1', 'ipv6')

/** Whether `address` is this machine's: an address in 127/8 or ::1 (never a name, or whatever else a header holds). */
export const isLoopback = remembered((address: string): boolean => {
  const plain = plainAddress(address)
  const family = net.isIP(plain)
  return family > 0 && LOOPBACK.check(plain, family === 6 ? 'ipv6' : 'ipv4')
})

/**
 * `f` of the addresses it was last asked about, remembered (up to 4,096, then forgotten at once): a
 * request's peer is asked about on every request of its keep-alive connection, and BlockList.check
 * and the address parsing cost microseconds each time.
 */
function remembered<T>(f: (address: string) => T): (address: string) => T {
  const known = new Map<string, T>()
  return (address) => {
    let answer = known.get(address)
    if (answer === undefined) {
      if (known.size >= 4096) known.clear()
      known.set(address, (answer = f(address)))
    }
    return answer
  }
}

/**
 * What an X-Forwarded-For hop names: an address, also one written with its port (`203.0.113.5:4444`,
 * `[2001:db8::5]:4444`, as some balancers write them), or anything else as it is (`unknown`).
 */
function hopAddress(hop: string): string {
  const withPort = /^\[([^\]]+)\](?::\d+)?$|^(\d+\.\d+\.\d+\.\d+):\d+$/.exec(hop)
  const address = withPort ? (withPort[1] ?? withPort[2]) : hop
  return net.isIP(address) ? plainAddress(address) : hop
}

/**
 * Who per-IP limits count a client as: its IPv4 address, or the /64 its IPv6 address is in. A /64
 * is one site's or subscriber's usual allocation, and any of its 2^64 addresses is theirs to use.
 */
export const limitKey = remembered((address: string): string => {
  const plain = plainAddress(address).replace(/%.*$/, '') // (a zone: fe80::1%eth0)
  if (!net.isIPv6(plain)) return plain
  const [head, tail] = plain.includes('::') ? plain.split('::') : [plain, '']
  const groups = (part: string) => (part ? part.split(':').flatMap((g) => (g.includes('.') ? ['0', '0'] : [g])) : []) // (an IPv4 tail is two groups, past the /64)
  const [h, t] = [groups(head), groups(tail)]
  const all = [...h, ...Array<string>(8 - h.length - t.length).fill('0'), ...t]
  return `${all.slice(0, 4).map((g) => parseInt(g, 16).toString(16)).join(':')}::/64`
})

export class ClientAddresses {
  private readonly trusted = new BlockList()
  /** What PROXY headers declared, by the connection's own address and port (a TLS socket's are its TCP socket's). */
  private readonly declared = new Map<string, string>()

  constructor(cidrs: string[]) {
    for (const cidr of cidrs) {
      const [address, bits] = cidr.split('/')
      const type = net.isIPv6(address) ? 'ipv6' : 'ipv4'
      if (!net.isIP(address)) throw new Error(`--trust-proxy ${cidr}: not an address or CIDR range`)
      this.trusted.addSubnet(address, bits === undefined ? (type === 'ipv6' ? 128 : 32) : Number(bits), type)
    }
    this.any = cidrs.length > 0
  }

  /** Whether any range is trusted (else every client is its TCP peer, looked at no further). */
  readonly any: boolean

  isTrusted(address: string): boolean {
    const plain = plainAddress(address)
    return net.isIP(plain) > 0 && this.trusted.check(plain, net.isIPv6(plain) ? 'ipv6' : 'ipv4')
  }

  /**
   * The client's address: the TCP peer, unless that is a trusted balancer; then what its PROXY
   * header declared, else the nearest untrusted hop of X-Forwarded-For (if `headers` are given).
   */
  of(socket: Socket, headers?: IncomingMessage['headers']): string {
    if (!this.any) return socket.remoteAddress ?? '?'
    const peer = plainAddress(socket.remoteAddress ?? '?')
    if (!this.isTrusted(peer)) return peer
    const declared = this.declared.get(keyOf(socket))
    if (declared) return declared
    const forwarded = headers?.['x-forwarded-for']
    if (!forwarded) return peer
    const hops = (Array.isArray(forwarded) ? forwarded.join(',') : forwarded).split(',').map((h) => hopAddress(h.trim())).filter(Boolean)
    // From the right: each trusted hop vouches for the one before it. A hop that is not an address
    // was written by a trusted one all the same: it ends the walk (skipping it would let the client's own claim through).
    for (let i = hops.length - 1; i >= 0; i--) if (!this.isTrusted(hops[i]) || i === 0) return hops[i]
    return peer
  }

  /**
   * Hands `socket` to `accept` once its PROXY header, if a trusted peer sent one, has been read off
   * (the bytes behind it are put back). An untrusted peer's bytes go on untouched; a malformed
   * header, or one that does not come within `timeoutMs`, ends the connection.
   */
  take(socket: Socket, accept: (socket: Socket) => void, timeoutMs: number) {
    if (!this.isTrusted(socket.remoteAddress ?? '')) return accept(socket)
    let got: Buffer = Buffer.alloc(0)
    const timer = setTimeout(() => socket.destroy(), timeoutMs).unref()
    const onData = (chunk: Buffer) => {
      got = got.length ? Buffer.concat([got, chunk]) : chunk
      let header
      try {
        header = readProxyHeader(got)
      } catch (err) {
        if (err instanceof ProxyProtocolError) return socket.destroy()
        throw err
      }
      if (header.kind === 'more') return
      socket.off('data', onData)
      clearTimeout(timer)
      socket.pause()
      const rest = header.kind === 'header' ? got.subarray(header.length) : got
      if (header.kind === 'header' && header.address) {
        const key = keyOf(socket)
        this.declared.set(key, plainAddress(header.address))
        socket.once('close', () => this.declared.delete(key))
      }
      if (rest.length) socket.unshift(rest)
      accept(socket)
      // (HTTP reads on, through its 'data' listener; TLS took the socket's handle and the bytes put back, and a
      // resumed socket with no listener would drop them.)
      if (socket.listenerCount('data')) socket.resume()
    }
    socket.on('data', onData)
    socket.once('error', () => clearTimeout(timer))
  }
}

const keyOf = (socket: Socket) => `${socket.remoteAddress}|${socket.remotePort}`
