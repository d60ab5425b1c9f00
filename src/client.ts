import pg from 'pg'
import { configKeys, type EdgeConfig } from './config'
import { WebSocketSocket } from './socket'

export type ClientConfig = pg.ClientConfig & EdgeConfig
export type PoolConfig = pg.PoolConfig & EdgeConfig

/**
 * Split a user's config into pg's part and edgepg's own keys, so pg never sees ours. Copies
 * property descriptors because pg-pool hands its clients a non-enumerable `password`.
 */
function splitConfig(input?: string | ClientConfig): { options: pg.ClientConfig; own: EdgeConfig } {
  if (typeof input === 'string') return { options: { connectionString: input }, own: {} }
  const options = Object.defineProperties({}, Object.getOwnPropertyDescriptors(input ?? {})) as ClientConfig
  const own: EdgeConfig = {}
  for (const key of configKeys) {
    if (key in options) {
      ;(own as any)[key] = options[key]
      delete options[key]
    }
  }
  return { options, own }
}

/** node-postgres's Client, connected over a WebSocket to edgepg-proxy. */
export class Client extends pg.Client {
  /** This client's overrides of the global `config`. */
  readonly edgeConfig: EdgeConfig

  constructor(config?: string | ClientConfig) {
    const { options, own } = splitConfig(config)
    if (!options.stream) options.stream = () => new WebSocketSocket(own) as any
    super(options)
    this.edgeConfig = own
    // The channel's security comes from wss:// (as with Neon's forceDisablePgSSL); pg-level TLS
    // would need TLS inside the WebSocket, so `ssl`/`sslmode` from a connection string is set aside.
    this.ssl = false
    ;(this.connection as any).ssl = false
  }
}

/** node-postgres's Pool of edgepg Clients. */
export class Pool extends pg.Pool {
  constructor(config?: PoolConfig) {
    super({ ...config, Client: Client as any })
  }
}
