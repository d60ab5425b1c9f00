import net from 'node:net'
import dns from 'node:dns/promises'
import { formatHostPort, parseHostPort, type HostPort } from './address'
import { isLoopback } from '../listen/client-address'

/**
 * Which Postgres a client may reach: the proxy's upstream, and the exact `--allow` entries. A name
 * on the allow-list stands for the addresses it had when first used: a client goes to one of those,
 * never to wherever the name points later (DNS rebinding).
 *
 * One rule for every route (`?address=` on /v1 and /v2, the connection string's host on /sql): the
 * upstream or an --allow entry, named exactly, is where the client goes. At the upstream's port, the
 * proxy's own host (the one the request was sent to: Neon's drivers name their endpoint) and, for an
 * upstream on this machine, any loopback name also stand for the upstream, as a /v2 session naming
 * nothing does. Anything else is refused: never another port, never another machine.
 */
export class Upstreams {
  readonly upstream: HostPort
  private readonly allowed: Set<string>
  private readonly pinned = new Map<string, Promise<Set<string>>>()

  constructor(
    upstream: string,
    allow: string[] = [],
    private readonly lookup: (host: string) => Promise<string[]> = async (host) => (await dns.lookup(host, { all: true })).map((a) => a.address)
  ) {
    this.upstream = parseHostPort(upstream)
    this.allowed = new Set([this.upstream, ...allow.map((a) => parseHostPort(a))].map(formatHostPort))
  }

  has(target: HostPort): boolean {
    return this.allowed.has(formatHostPort(target))
  }

  /** Where a client naming `named` in a request sent to `sentTo` (its Host header) goes, by the rule above: undefined if nowhere. */
  pick(named: HostPort, sentTo: string | undefined): HostPort | undefined {
    if (this.has(named)) return named
    if (named.port !== this.upstream.port) return undefined
    if (loopbackName(named.host) && loopbackName(this.upstream.host)) return this.upstream
    try {
      return named.host === parseHostPort(sentTo ?? '').host ? this.upstream : undefined
    } catch {
      return undefined
    }
  }

  /** For an allowed host name: an address it resolves to now that it had when first used, if any. */
  async pinnedAddress(target: HostPort): Promise<string | undefined> {
    const key = formatHostPort(target)
    if (!this.pinned.has(key)) this.pinned.set(key, this.lookup(target.host).then((ips) => new Set(ips)))
    const [known, now] = await Promise.all([this.pinned.get(key)!, this.lookup(target.host)])
    return now.find((ip) => known.has(ip))
  }

  /** Where a client naming `named` goes: false if nowhere, else `named` (a name pinned to its address). */
  async admit(named: HostPort): Promise<false | HostPort> {
    if (!this.has(named)) return false
    if (net.isIP(named.host) || formatHostPort(named) === formatHostPort(this.upstream)) return named
    const ip = await this.pinnedAddress(named)
    return ip ? { ...named, address: ip } : false
  }
}

/** Why a client naming `named` is refused (the same words on every route), and what it may name instead. */
export const notAllowed = (named: HostPort, upstream: HostPort) =>
  `${formatHostPort(named)} is not an allowed upstream: name the proxy's own host, its upstream ${formatHostPort(upstream)}, or an address allowed with --allow`

const loopbackName = (host: string) => host === 'localhost' || isLoopback(host)
