/**
 * A proxy near its users, far from Postgres (issue 35's topology B): a relay between edgepg-proxy and
 * Postgres holds every chunk half an RTT each way, so time counts proxy↔Postgres round trips.
 */
import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { Client, httpSql } from '../src/index'
import { startDelayRelay } from './support/delay-relay'
import { edgeConfig, eventually, pgConfig, scratchTable, startProxy, testPostgres, within } from './support/helpers'
import { generateCerts } from './support/certs'
import { startPostgres, tlsOnly } from './support/stack'

const ONE_WAY_MS = 60
let relay: Awaited<ReturnType<typeof startDelayRelay>>
let proxy: Awaited<ReturnType<typeof startProxy>>
let table: Awaited<ReturnType<typeof scratchTable>>

before(async () => {
  relay = await startDelayRelay(testPostgres(), ONE_WAY_MS)
  proxy = await startProxy({ upstream: `127.0.0.1:${relay.port}` })
  table = await scratchTable('far', 'id int PRIMARY KEY, n int NOT NULL')
  await table.tcp.query(`INSERT INTO ${table.name} VALUES (1, 0)`)
})

after(async () => {
  await proxy?.close()
  await relay?.close()
  await table?.drop()
})

const sqlFar = () => {
  const { user, password, database } = pgConfig('scram_user')
  return httpSql(`postgresql://${user}:${encodeURIComponent(String(password))}@127.0.0.1:${relay.port}/${database}`, { fetchEndpoint: `http://127.0.0.1:${proxy.port}/sql` })
}

/** The round trips to Postgres `fn` took, as whole RTTs (elapsed / RTT, rounded down). */
async function roundTrips(fn: () => Promise<unknown>) {
  const t0 = performance.now()
  await fn()
  return Math.floor((performance.now() - t0) / relay.rttMs)
}

test('/sql: a batch (sql.transaction) reaches Postgres in one round trip, with its BEGIN, COMMIT and reset', async () => {
  const sql = sqlFar()
  await sql.query('SELECT 1') // (the key's first login: a backend near the proxy's end of the link)
  const update = `UPDATE ${table.name} SET n = n + 1 WHERE id = 1`
  const trips = await roundTrips(async () => {
    const [updated, [row]] = (await sql.transaction([sql.query(update), sql.query(`SELECT n FROM ${table.name} WHERE id = 1`)])) as [unknown[], Array<{ n: number }>]
    assert.deepEqual(updated, [])
    assert.equal(row.n, 1)
  })
  assert.equal(trips, 1, `${trips} round trips of ${relay.rttMs} ms`)
})

test('/sql: a batch that fails in one round trip: the first error is its own (not "transaction aborted"), and what ran before it is rolled back', async () => {
  const sql = sqlFar()
  await sql.query('SELECT 1')
  const { rows: [before] } = await table.tcp.query(`SELECT n FROM ${table.name} WHERE id = 1`)
  let err: any
  const trips = await roundTrips(async () => {
    err = await sql.transaction([sql.query(`UPDATE ${table.name} SET n = n + 1 WHERE id = 1`), sql.query('SELECT 1 / 0'), sql.query('SELECT 2')]).catch((e) => e)
  })
  assert.equal(err?.code, '22012', `the division's error: ${err?.message}`)
  assert.equal(trips, 1, `${trips} round trips of ${relay.rttMs} ms`)
  const { rows: [after] } = await table.tcp.query(`SELECT n FROM ${table.name} WHERE id = 1`)
  assert.equal(after.n, before.n, 'the update before the error rolled back')
  assert.deepEqual(await sql.query('SELECT 3 AS three'), [{ three: 3 }], 'the next request runs')
})

test('/sql: a batch that may end its transaction goes statement by statement, and is refused as before', async () => {
  const sql = sqlFar()
  const err: any = await sql.transaction([sql.query('SELECT 1'), sql.query('COMMIT'), sql.query(`UPDATE ${table.name} SET n = n + 100 WHERE id = 1`)]).catch((e) => e)
  assert.match(String(err?.message), /statement 2 of the batch ended its transaction/)
  const { rows: [row] } = await table.tcp.query(`SELECT n FROM ${table.name} WHERE id = 1`)
  assert.ok(row.n < 100, 'the statement after the COMMIT never ran')
})

test("no cliff after idle: a key's last backend stays past --pool-idle-timeout and is replaced before --pool-max-lifetime, so a fresh Client's first row costs one round trip to Postgres", async () => {
  const LIFETIME_MS = 8000
  const near = await startProxy({ upstream: `127.0.0.1:${relay.port}`, pool: { idleTimeoutMs: 300, maxLifetimeMs: LIFETIME_MS } })
  const renewals = async () => Number(/^edgepg_proxy_pool_renewals_total (\d+)$/m.exec(await (await fetch(`http://127.0.0.1:${near.port}/metrics`)).text())?.[1])
  const firstRow = async () => {
    const client = new Client(edgeConfig(near.port))
    const trips = await roundTrips(async () => {
      await client.connect()
      assert.deepEqual((await client.query('SELECT 1 AS one')).rows, [{ one: 1 }])
    })
    await client.end()
    return trips
  }
  try {
    assert.ok((await firstRow()) >= 3, "the key's first login crosses the link, several times")
    await new Promise((r) => setTimeout(r, 1000)) // (past the idle timeout, three times over)
    assert.equal(await firstRow(), 1, 'after idling: the login answered near the client, the query one round trip')
    await eventually(async () => (await renewals()) >= 1, 'the backend replaced ahead of its lifetime', LIFETIME_MS + 5000, 200)
    await new Promise((r) => setTimeout(r, 1500)) // (the old one past its lifetime now)
    assert.equal(await firstRow(), 1, 'after the lifetime: its replacement, already logged in')
  } finally {
    await near.close()
  }
})

test('a link to Postgres that is lost is noticed and replaced: a session holding no backend goes on, and never hears of it', async () => {
  const cutting = await startDelayRelay(testPostgres(), ONE_WAY_MS)
  const near = await startProxy({ upstream: `127.0.0.1:${cutting.port}` })
  const client = new Client(edgeConfig(near.port))
  const errors: Error[] = []
  client.on('error', (err) => errors.push(err))
  try {
    await client.connect()
    const before = (await client.query('SELECT pg_backend_pid() AS pid')).rows[0].pid
    const discards = async () => Number(/^edgepg_proxy_pool_discards_total (\d+)$/m.exec(await near.metrics.registry.metrics())?.[1])
    const discarded = await discards()
    cutting.cut() // (every link under way: the session's parked backend, the pool's idle ones)
    // (A statement sent in the very instant its parked backend's link dies fails, as on a TCP connection of its own.)
    await eventually(async () => (await discards()) > discarded, 'the proxy to notice')
    const after = await within(5000, 'the query after the cut', client.query('SELECT pg_backend_pid() AS pid'))
    assert.notEqual(after.rows[0].pid, before, 'a fresh backend')
    const other = new Client(edgeConfig(near.port))
    await other.connect()
    assert.deepEqual((await other.query('SELECT 1 AS one')).rows, [{ one: 1 }])
    await other.end()
    assert.deepEqual(errors, [])
  } finally {
    await client.end()
    await near.close()
    await cutting.close()
  }
})

test('--upstream-sslmode verify-full across the long link: the handshake is paid by the first login only; fresh Clients after it cost one round trip', async () => {
  const certs = await generateCerts()
  const tlsPg = await startPostgres(tlsOnly(18, certs.server))
  const wan = await startDelayRelay(tlsPg, ONE_WAY_MS)
  const near = await startProxy({ upstream: `127.0.0.1:${wan.port}`, upstreamTls: { mode: 'verify-full', ca: certs.ca.cert } })
  const firstRow = async () => {
    const client = new Client({ ...edgeConfig(near.port), host: '127.0.0.1', port: wan.port })
    const trips = await roundTrips(async () => {
      await client.connect()
      assert.deepEqual((await client.query('SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()')).rows, [{ ssl: true }])
    })
    await client.end()
    return trips
  }
  try {
    assert.ok((await firstRow()) >= 4, 'the first login: TCP, TLS and SCRAM across the link')
    await new Promise((r) => setTimeout(r, 4 * wan.rttMs)) // (its backend back in the pool)
    assert.equal(await firstRow(), 1, 'then: the login answered near the client, over the verified link already made')
  } finally {
    await near.close()
    await wan.close()
    await tlsPg.stop()
  }
})
