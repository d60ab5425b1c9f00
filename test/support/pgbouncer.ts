/**
 * A PgBouncer (Debian's package; .ci/run installs it) in transaction mode in front of the test
 * Postgres, for the tests that put edgepg-proxy in front of it. As root it runs as the user
 * test/support/pg-server.ts runs Postgres as (PgBouncer will not run as root either).
 */
import { spawn, execFileSync } from 'node:child_process'
import { mkdtemp, rm, writeFile } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import pg from 'pg'
import { eventually } from './helpers'
import { giveToRunner, runner } from './pg-server'
import { freePort, pgConfig, PASSWORD, type PgInfo } from './stack'

export interface PgBouncer {
  port: number
  pid: number
  stop(): Promise<void>
}

/** The pgbouncer binary, or undefined when it is not installed. */
export function pgbouncerBinary(): string | undefined {
  try {
    return execFileSync('sh', ['-c', 'command -v pgbouncer || ls /usr/sbin/pgbouncer'], { encoding: 'utf8' }).trim()
  } catch {
    return undefined
  }
}

/**
 * Starts PgBouncer for `scram_user` on `upstream`'s database; `settings` go into its [pgbouncer] section.
 * `users` go into its auth_file beside (or instead of) scram_user's plain password: name -> password, or
 * Postgres's SCRAM verifier (pg_authid.rolpassword), with which PgBouncer spends no PBKDF2 on a login.
 */
export async function startPgBouncer(upstream: PgInfo, settings: Record<string, string | number> = {}, users: Record<string, string> = {}): Promise<PgBouncer> {
  const binary = pgbouncerBinary()
  if (!binary) throw new Error('pgbouncer is not installed: apt-get install pgbouncer (.ci/run does this)')
  const dir = await mkdtemp(join(tmpdir(), 'edgepg-pgbouncer-'))
  await giveToRunner(dir, 0o700)
  const port = await freePort()
  const file = (name: string, text: string) => writeFile(join(dir, name), text).then(() => giveToRunner(join(dir, name), 0o600))
  await file('userlist.txt', Object.entries({ scram_user: PASSWORD, ...users }).map(([name, secret]) => `"${name}" "${secret}"\n`).join(''))
  const ini = {
    listen_addr: '127.0.0.1',
    listen_port: port,
    unix_socket_dir: '',
    auth_type: 'scram-sha-256',
    auth_file: join(dir, 'userlist.txt'),
    pool_mode: 'transaction',
    logfile: join(dir, 'pgbouncer.log'),
    ...settings,
  }
  await file('pgbouncer.ini', [
    '[databases]',
    `${upstream.database} = host=${upstream.host} port=${upstream.port} dbname=${upstream.database}`,
    '[pgbouncer]',
    ...Object.entries(ini).map(([key, value]) => `${key} = ${value}`),
    '',
  ].join('\n'))
  const { uid, gid } = runner()
  const bouncer = spawn(binary, [join(dir, 'pgbouncer.ini')], { uid, gid, stdio: 'ignore' })
  const exited = new Promise((resolve) => (bouncer.exitCode !== null ? resolve(null) : bouncer.once('exit', resolve)))
  const stop = async () => {
    bouncer.kill('SIGTERM')
    await exited
    await rm(dir, { recursive: true, force: true })
  }
  try {
    await eventually(async () => {
      const c = new pg.Client({ ...pgConfig('scram_user', upstream), port })
      return c.connect().then(() => c.end().then(() => true), () => false)
    }, 'PgBouncer to accept connections', 10000)
  } catch (err) {
    await stop()
    throw err
  }
  return { port, pid: bouncer.pid!, stop }
}
