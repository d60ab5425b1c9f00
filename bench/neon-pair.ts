/**
 * The shape of Neon's "-pooler" endpoints from its open-source parts, for bench/pool.ts: Neon's Go
 * WebSocket relay wsproxy (github.com/neondatabase/wsproxy: each binary message to a TCP socket as it
 * is, each read back as one message; the target from its URL's `?address=host:port`) in front of
 * Debian's PgBouncer (transaction mode). Its clients are edgepg Clients with `wsProxy` at wsproxy.
 * wsproxy is not installed by anything here: EDGEPG_WSPROXY_BIN, else /work/ext/wsproxy/wsproxy.
 */
import { spawn } from 'node:child_process'
import { existsSync } from 'node:fs'
import net from 'node:net'
import type pg from 'pg'
import { WebSocket } from 'ws'
import type { ClientConfig } from '../src/index'
import { eventually } from '../test/support/helpers'
import { pgbouncerBinary, startPgBouncer } from '../test/support/pgbouncer'
import { freePort, type PgInfo } from '../test/support/stack'
import { treeCpuSeconds } from './lib'

const WSPROXY_BIN = process.env.EDGEPG_WSPROXY_BIN ?? '/work/ext/wsproxy/wsproxy'
export const NEON_PAIR = 'edgepg Client via wsproxy → PgBouncer (transaction)'

/** Why the pair cannot run here (one line, with how to get what is missing), or undefined. */
export function neonPairMissing(): string | undefined {
  if (!pgbouncerBinary()) return 'pool: wsproxy → PgBouncer skipped: pgbouncer is not installed (apt-get install pgbouncer).'
  if (!existsSync(WSPROXY_BIN))
    return `pool: wsproxy → PgBouncer skipped: no wsproxy at ${WSPROXY_BIN} (git clone https://github.com/neondatabase/wsproxy /work/ext/wsproxy && cd /work/ext/wsproxy && go build; or set EDGEPG_WSPROXY_BIN).`
  return undefined
}

/** The roles' SCRAM verifiers from pg_authid, for PgBouncer's auth_file (a plain password there costs a PBKDF2 per login). */
export async function scramSecrets(admin: pg.Client, roles: string[]): Promise<Record<string, string>> {
  const { rows } = await admin.query(`SELECT rolname, rolpassword FROM pg_authid WHERE rolname = ANY($1)`, [roles])
  return Object.fromEntries(rows.map((r) => [r.rolname, r.rolpassword]))
}

export interface NeonPair {
  /** edgepg config for `base` (host, port, role of Postgres) through wsproxy and PgBouncer. */
  config(base: pg.ClientConfig): ClientConfig
  /** CPU seconds used so far by wsproxy and PgBouncer (from /proc). */
  cpu(): number
  stop(): Promise<void>
}

/** PgBouncer (pool_mode transaction; `settings` over it) for the `roles` by their SCRAM verifiers, and wsproxy in front of it. */
export async function startNeonPair(db: PgInfo, admin: pg.Client, roles: string[], settings: Record<string, string | number>): Promise<NeonPair> {
  const bouncer = await startPgBouncer(db, settings, await scramSecrets(admin, roles))
  const [port, metrics] = [await freePort(), await freePort()]
  const env = { LISTEN_PORT: `127.0.0.1:${port}`, PROMETHEUS_BIND: `127.0.0.1:${metrics}`, ALLOW_ADDR_REGEX: `^${db.host.replace(/\./g, "\\.")}:${bouncer.port}$`, LOG_CONN_INFO: 'false' }
  const relay = spawn(WSPROXY_BIN, [], { env: { ...process.env, ...env }, stdio: 'ignore' })
  const exited = new Promise((resolve) => relay.once('exit', resolve))
  const stop = async () => {
    if (relay.exitCode === null) relay.kill('SIGTERM'), await exited
    await bouncer.stop()
  }
  try {
    const up = () => new Promise<boolean>((resolve) => net.connect(port, '127.0.0.1').once('connect', function (this: net.Socket) { this.destroy(), resolve(true) }).once('error', () => resolve(false)))
    await eventually(up, 'wsproxy to listen', 10_000)
  } catch (err) {
    await stop()
    throw err
  }
  return {
    config: (base) => ({ ...base, port: bouncer.port, webSocketConstructor: WebSocket as any, wsProxy: (host, p) => `ws://127.0.0.1:${port}/v1?address=${host}:${p}`, authOffload: false } as ClientConfig),
    cpu: () => treeCpuSeconds(relay.pid!) + treeCpuSeconds(bouncer.pid),
    stop,
  }
}
