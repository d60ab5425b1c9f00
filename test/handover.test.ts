/**
 * Replacing a running proxy on one host without refusing anyone (docs/deployment.md, "Replacing a running proxy"):
 * SIGUSR2 to the primary of `--workers 2` replaces each worker in turn from the code on disk while
 * new sessions, /sql requests and health checks keep arriving on the one port, and a session open
 * on a retiring worker goes on until it ends by itself.
 */
import { test } from 'node:test'
import assert from 'node:assert/strict'
import { Client, httpSql } from '../src/index'
import { startChildProxy } from './support/child-proxy'
import { edgeConfig, eventually, pgConfig, testPostgres } from './support/helpers'

test('SIGUSR2: every worker is replaced, one at a time, while sessions, /sql and /healthz on the port are all served; an open transaction finishes on its retiring worker', async () => {
  const { host, port } = testPostgres()
  const p = await startChildProxy(`${host}:${port}`, { built: true, env: { EDGEPG_WORKERS: '2' }, flags: ['--shutdown-grace', '10000', '--max-sessions-per-ip', '1000'] })
  const workers = () => [...new Set(p.lines.filter((l) => l.listening).map((l) => l.pid as number))]
  try {
    await eventually(() => workers().length === 2, 'both workers listening', 15_000)
    const first = workers()

    // A transaction open across the handover, on whichever worker took it.
    const open = new Client(edgeConfig(p.port))
    await open.connect()
    await open.query('BEGIN')
    assert.deepEqual((await open.query('SELECT 1 AS one')).rows, [{ one: 1 }])

    const { user, password, database } = pgConfig('scram_user')
    const sql = httpSql(`postgresql://${user}:${encodeURIComponent(String(password))}@${host}:${port}/${database}`, { fetchEndpoint: `http://127.0.0.1:${p.port}/sql` })
    const failures: string[] = []
    let served = 0
    let running = true
    const traffic = Array.from({ length: 3 }, async () => {
      for (; running; served++) {
        try {
          const c = new Client(edgeConfig(p.port))
          await c.connect()
          assert.deepEqual((await c.query('SELECT 2 AS two')).rows, [{ two: 2 }])
          await c.end()
          assert.deepEqual(await sql.query('SELECT 3 AS three'), [{ three: 3 }])
          const health = await fetch(`http://127.0.0.1:${p.port}/healthz`)
          await health.text()
          assert.equal(health.status, 200, '/healthz')
        } catch (err) {
          failures.push((err as Error).message)
        }
      }
    })
    await eventually(() => served >= 10, 'traffic under way')

    const before = served
    process.kill(p.child.pid!, 'SIGUSR2')
    await eventually(() => p.lines.some((l) => l.handover === 'retiring: the other workers accept meanwhile'), 'a worker to retire')
    // The open transaction's worker may be the one retiring: it goes on there.
    assert.deepEqual((await open.query('SELECT 4 AS four')).rows, [{ four: 4 }])
    await open.query('COMMIT')
    await open.end()
    await eventually(() => p.lines.some((l) => l.handover === 'done'), 'the handover to finish', 60_000)
    running = false
    await Promise.all(traffic)

    assert.deepEqual(failures, [], 'nothing refused or failed during the handover')
    assert.ok(served - before >= 10, `traffic ran throughout (${served - before} rounds during the handover)`)
    const now = workers().filter((pid) => !first.includes(pid))
    assert.equal(now.length, 2, `two new workers (listening: ${workers()}; first ${first})`)
    assert.equal(p.lines.filter((l) => l.replacedBy).length, 2, 'each worker replaced once')
  } finally {
    await p.stop()
  }
})
