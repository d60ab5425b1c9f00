import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { Pool } from '../src/index'
import { edgeConfig, startProxy } from './support/helpers'
import { startPgBouncer, type PgBouncer } from './support/pgbouncer'
import { testPostgres } from './support/stack'

// edgepg-proxy in front of PgBouncer in transaction mode.
let bouncer: PgBouncer
let bouncerPort: number
before(async () => {
  bouncer = await startPgBouncer(testPostgres(), { default_pool_size: 2, max_client_conn: 100, ignore_startup_parameters: 'application_name' })
  bouncerPort = bouncer.port
})
after(() => bouncer?.stop())

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
