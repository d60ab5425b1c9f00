/** `host:port` / `[v6]:port` parsing shared by the proxy's options and its `?address=` check. */
export interface HostPort {
  host: string
  port: number
  /** The IP to connect to, when `host` is a name the proxy has already resolved and checked. */
  address?: string
}

export function parseHostPort(text: string, defaultPort = 5432): HostPort {
  const m = /^(?:\[([^\]]+)\]|([^:\[\]]+))(?::(\d+))?$/.exec(text.trim())
  if (!m) throw new Error(`invalid address "${text}": expected host:port`)
  const port = m[3] === undefined ? defaultPort : Number(m[3])
  if (!(port > 0 && port < 65536)) throw new Error(`invalid port in "${text}"`)
  return { host: (m[1] ?? m[2]).toLowerCase(), port }
}

export const formatHostPort = ({ host, port }: HostPort) => (host.includes(':') ? `[${host}]:${port}` : `${host}:${port}`)
