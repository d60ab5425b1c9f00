/**
 * A hot standby streaming from a test Postgres, made without pg_basebackup (the embedded binaries
 * have none), by the low-level backup API: a replication slot, pg_backup_start(), a copy of the
 * data directory, pg_backup_stop() (its labelfile becomes backup_label), then standby.signal and
 * primary_conninfo. Its primary must take replication logins: start it with `replicable()`.
 */
import { spawnSync } from 'node:child_process'
import { mkdtemp, rm, writeFile, appendFile } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import pg from 'pg'
import { giveToRunner, runner, startServer, type Server } from './pg-server'
import { freePort, hbaLines, PASSWORD, ROLES, startPostgres, type Postgres, type PostgresOptions } from './stack'

/** Options for a primary a standby can stream from: the default roles, and `postgres` may log in for replication. */
export function replicable(options: PostgresOptions = {}): PostgresOptions {
  return {
    ...options,
    hba: ['local all all trust', ...hbaLines(options.roles ?? ROLES), 'host all all 127.0.0.1/32 scram-sha-256', 'host replication postgres 127.0.0.1/32 scram-sha-256'],
  }
}

export interface Standby {
  host: string
  port: number
  /** A superuser pg.Client straight to the standby (not connected yet). */
  admin(): pg.Client
  /** Replay WAL this long after its commit on the primary (recovery_min_apply_delay; 0: at once). */
  delay(ms: number): Promise<void>
  /** Resolves once the standby has replayed all the primary had written when called. */
  caughtUp(): Promise<void>
  /** Fast shutdown; `start` brings it back on the same port. */
  shutdown(): Promise<void>
  start(): Promise<void>
  /** Shuts down and deletes its data, and its slot on the primary. */
  stop(): Promise<void>
}

let made = 0

export async function startStandby(primary: Postgres, name = 'standby'): Promise<Standby> {
  const { uid, gid } = runner()
  const slot = `edgepg_${process.pid}_${made++}`
  const dir = await mkdtemp(join(tmpdir(), `edgepg-${name}-`))
  await giveToRunner(dir, 0o700)
  const dataDir = join(dir, 'data')
  const port = await freePort()
  const c = primary.admin()
  await c.connect()
  try {
    await c.query('SELECT pg_create_physical_replication_slot($1, true)', [slot])
    await c.query("SELECT pg_backup_start('edgepg standby', true)")
    // As the server's own user, so that ownership and modes stay as Postgres wants them.
    const copy = spawnSync('cp', ['-a', primary.dataDir, dataDir], { uid, gid, encoding: 'utf8' })
    if (copy.status !== 0) throw new Error(`copying the data directory failed: ${copy.stderr}`)
    const { rows } = await c.query('SELECT labelfile FROM pg_backup_stop(true)')
    for (const f of ['postmaster.pid', 'postmaster.opts']) await rm(join(dataDir, f), { force: true })
    await writeFile(join(dataDir, 'backup_label'), rows[0].labelfile)
    await writeFile(join(dataDir, 'standby.signal'), '')
    await appendFile(join(dataDir, 'postgresql.auto.conf'), `primary_conninfo = 'host=127.0.0.1 port=${primary.port} user=postgres password=${PASSWORD} application_name=${slot}'\nprimary_slot_name = '${slot}'\n`)
    for (const f of ['backup_label', 'standby.signal', 'postgresql.auto.conf']) await giveToRunner(join(dataDir, f), 0o600)
  } catch (err) {
    await c.query('SELECT pg_drop_replication_slot($1)', [slot]).catch(() => {})
    await rm(dir, { recursive: true, force: true })
    throw err
  } finally {
    await c.end()
  }
  const log = process.env.EDGEPG_PG_LOG ? (line: string) => console.error(`[${name}]`, line) : undefined
  let server: Server | undefined
  const start = async () => void (server = await startServer(primary.version, dataDir, port, primary.flags, log))
  await start()
  const admin = () => new pg.Client({ host: '127.0.0.1', port, user: 'postgres', password: PASSWORD, database: 'postgres' })
  const one = async <T>(on: () => pg.Client, sql: string, values: unknown[] = []): Promise<T> => {
    const client = on()
    await client.connect()
    try {
      return (await client.query(sql, values)).rows[0] as T
    } finally {
      await client.end()
    }
  }
  const standby: Standby = {
    host: '127.0.0.1',
    port,
    admin,
    async delay(ms) {
      await one(admin, `ALTER SYSTEM SET recovery_min_apply_delay = '${ms}ms'`)
      await one(admin, 'SELECT pg_reload_conf()')
      const deadline = Date.now() + 5000
      while ((await one<{ ms: string }>(admin, "SELECT setting AS ms FROM pg_settings WHERE name = 'recovery_min_apply_delay'")).ms !== String(ms)) {
        if (Date.now() > deadline) throw new Error('the standby did not take recovery_min_apply_delay')
        await new Promise((r) => setTimeout(r, 20))
      }
    },
    async caughtUp() {
      const { lsn } = await one<{ lsn: string }>(primary.admin, 'SELECT pg_current_wal_insert_lsn()::text AS lsn')
      const deadline = Date.now() + 15_000
      while (!(await one<{ ok: boolean }>(admin, 'SELECT pg_last_wal_replay_lsn() >= $1::pg_lsn AS ok', [lsn])).ok) {
        if (Date.now() > deadline) throw new Error(`the standby did not replay ${lsn} within 15 s`)
        await new Promise((r) => setTimeout(r, 20))
      }
    },
    shutdown: async () => server?.stop(),
    start,
    async stop() {
      await server?.stop().catch(() => {})
      await one(primary.admin, 'SELECT pg_drop_replication_slot($1)', [slot]).catch(() => {})
      await rm(dir, { recursive: true, force: true })
    },
  }
  return standby
}

/**
 * For checks of the built bundle: a primary of its own (`name`), a standby replaying `lagMs` behind
 * it, a table `reads (id, n)` holding one row, and the proxy options that read from the standby
 * (waiting up to 10 s for it to replay a session's position).
 */
export async function replicaFixture(name: string, lagMs = 300) {
  const primary = await startPostgres(replicable({ name }))
  const standby = await startStandby(primary, `${name}-standby`).catch(async (err) => (await primary.stop(), Promise.reject(err)))
  const admin = primary.admin()
  await admin.connect()
  await admin.query('CREATE TABLE reads (id int PRIMARY KEY, n int NOT NULL); INSERT INTO reads VALUES (1, 0)')
  await admin.end()
  await standby.caughtUp()
  await standby.delay(lagMs)
  return {
    upstream: `127.0.0.1:${primary.port}`,
    replicas: { addresses: [`127.0.0.1:${standby.port}`], maxLagMs: 60_000, waitMs: 10_000, autocommit: true },
    /** What the shared checks (test/runtimes/checks.js) take as `replica`, for a proxy on `proxyPort`. */
    checks: (proxyPort: number) => ({ proxyPort, port: primary.port, table: 'reads' }),
    async teardown() {
      await standby.stop()
      await primary.stop()
    },
  }
}
