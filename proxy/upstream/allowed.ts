import net from 'node:net'
import dns from 'node:dns/promises'
import { formatHostPort, parseHostPort, type HostPort } from './address'

/**
 * Which Postgres a client may reach: the proxy's upstream, and the exact `--allow` entries. A name
 * on the allow-list stands for the addresses it had when first used: a client goes to one of those,
 * never to wherever the name points later (DNS rebinding).
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
