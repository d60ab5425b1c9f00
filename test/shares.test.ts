/**
 * No one client, and no sessions that keep state, take a key's every backend (transaction pooling):
 * while another client waits, a client holds at most --max-backends-per-client, at most --max-pinned-sessions keep
 * theirs, and a session idle inside a transaction past --idle-in-transaction-timeout is ended as
 * Postgres ends one. Clients are told apart by address: the "other" client here connects from 127.0.0.2.
 */
import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { WebSocket } from 'ws'
import type { Client } from '../src/index'
import type { PoolOptions } from '../proxy/pool/backends'
import { startProxy, edgeClient, scratchTable, eventually, within, testPostgres } from './support/helpers'
import { isAccount, startHoldingRelay } from './support/delay-relay'

let scratch: Awaited<ReturnType<typeof scratchTable>>
before(async () => (scratch = await scratchTable('shares', 'x int')))
after(() => scratch?.drop())

type Proxy = Awaited<ReturnType<typeof startProxy>>
const proxy = (pool: PoolOptions) => startProxy({ pool: { mode: 'transaction', timeoutMs: 500, ...pool } })

/** A WebSocket from another loopback address: another client to the proxy. */
class FromElsewhere extends WebSocket {
  constructor(url: string, protocols?: string | string[]) {
    super(url, protocols, { localAddress: '127.0.0.2' })
  }
}

async function session(p: Proxy, elsewhere = false): Promise<Client & { errors: Error[] }> {
  const client = Object.assign(edgeClient(p.port, 'scram_user', elsewhere ? { webSocketConstructor: FromElsewhere as any } : {}), { errors: [] as Error[] })
  client.on('error', (err) => client.errors.push(err))
  await client.connect()
  return client
}

/** Sessions waiting for a backend now, as /metrics tells. */
const waiting = async (p: Proxy) => Number((await p.metrics!.registry.metrics()).match(/^edgepg_proxy_lend_waiting (\d+)/m)![1])

const outcome = (c: Client, sql: string) =>
  c.query(sql).then(
    (r) => ({ rows: r.rows }),
    (err) => ({ code: err.code as string, message: err.message as string })
  )

test('alone, a client may hold every backend; once another client waits, one idle in a transaction past --max-backends-per-client is ended for it (25P03 naming the flag)', async () => {
  const p = await proxy({ size: 4, maxPerClient: 2 })
  const hog = await Promise.all([session(p, true), session(p, true), session(p, true)])
  const other = await Promise.all([session(p), session(p)])
  try {
    for (const c of hog) await c.query('BEGIN') // three of four: no other client waits
    await other[0].query('BEGIN') // the fourth
    assert.deepEqual(await outcome(other[1], 'SELECT 2 AS two'), { rows: [{ two: 2 }] }, 'served at once, by a hog session ended for it')
    await eventually(async () => hog.some((c) => c.errors.length > 0), 'a hog session to be ended')
    const ended = hog.filter((c) => c.errors.length > 0)
    assert.equal(ended.length, 1)
    assert.equal((ended[0].errors[0] as Error & { code?: string }).code, '25P03')
    assert.match(ended[0].errors[0].message, /--max-backends-per-client/)
    // The hog keeps its share, and its next session waits while the other client is within its own.
    for (const c of hog.filter((c) => !c.errors.length)) assert.deepEqual(await outcome(c, 'SELECT 1 AS one'), { rows: [{ one: 1 }] })
  } finally {
    await Promise.all([...hog, ...other].map((c) => c.end().catch(() => {})))
    await p.close()
  }
})

test('past --max-pinned-sessions, a session that keeps state is closed with 53400 naming the flag; its backend is cleaned and lent on', async () => {
  const p = await proxy({ size: 2, maxPinned: 1, maxPerClient: 2 })
  const [a, b, c] = await Promise.all([session(p), session(p), session(p)])
  try {
    await a.query('CREATE TEMP TABLE pin_a (x int)') // pinned: one of two backends
    const pidB = (await b.query('SELECT pg_backend_pid() AS pid')).rows[0].pid
    await b.query('CREATE TEMP TABLE pin_b (x int)') // the transaction has run; keeping its state would pin past the cap
    await eventually(async () => b.errors.length > 0, 'b to be told')
    assert.equal((b.errors[0] as Error & { code?: string }).code, '53400')
    assert.match(b.errors[0].message, /--max-pinned-sessions/)
    // The backend b left is cleaned: c runs on it, without b's table, at once.
    const seen = (await within(3000, 'c', c.query("SELECT pg_backend_pid() AS pid, to_regclass('pg_temp.pin_b')::text AS t"))).rows[0]
    assert.deepEqual(seen, { pid: pidB, t: null })
    assert.deepEqual((await a.query("SELECT to_regclass('pg_temp.pin_a')::text AS t")).rows, [{ t: 'pin_a' }], 'a keeps its state')
  } finally {
    await Promise.all([a, b, c].map((x) => x.end().catch(() => {})))
    await p.close()
  }
})

/**
 * A pinned session that releases its state (an advisory lock) may leave the cap; the session that
 * takes the lock at that moment is asked what it keeps, and its answer may reach the proxy first:
 * before the other's account, or even before the other's own unlock has answered. Its pin then waits
 * for the other to settle, rather than be refused for a pin that is about to go. A relay in front of
 * Postgres holds the releasing session's account (`account`), or its unlock's own answer (`unlock`),
 * 300 ms on its way (the waiting pin's limit, 1 s, leaves room for the rest).
 */
for (const held of ['account', 'unlock'] as const) {
  test(`a session that would pin past --max-pinned-sessions while a pinned session may leave (its ${held} held on its way) waits, and is kept once the other leaves`, async () => {
    let armed = false
    const holds = (type: string, body: Buffer) =>
      armed && (held === 'unlock' ? type === 'T' && body.includes('released_4747') : isAccount(type, body) && !body.includes('lock')) ? ((armed = false), 300) : 0
    const relay = await startHoldingRelay(testPostgres(), holds)
    const p = await startProxy({ upstream: `127.0.0.1:${relay.port}`, pool: { mode: 'transaction', size: 3, timeoutMs: 3000, maxPinned: 1, maxPerClient: 3 } })
    const [a, b] = await Promise.all([session(p), session(p)])
    try {
      await a.query('SELECT pg_advisory_lock(4747)') // pinned: the one session the cap allows
      const taken = b.query('SELECT pg_advisory_lock(4747)') // waits at Postgres for a's lock
      await eventually(async () => (await scratch.tcp.query(`SELECT count(*)::int AS n FROM pg_locks WHERE locktype = 'advisory' AND objid = 4747 AND NOT granted`)).rows[0].n === 1, "b to wait for a's lock")
      armed = true // (a's is the first lock-free account, or unlock, from here: b's account holds the lock)
      await a.query('SELECT pg_advisory_unlock(4747) AS released_4747')
      await within(3000, 'b to take the lock', taken)
      // What the relay holds on a's connection (once it comes: a's account may follow b's) reaches the proxy before a's next answer.
      await eventually(async () => !armed, `a's ${held} to be held`)
      assert.deepEqual((await within(3000, 'a', a.query('SELECT 1 AS one'))).rows, [{ one: 1 }])
      const mine = await within(3000, 'b', b.query(`SELECT count(*)::int AS n FROM pg_locks WHERE locktype = 'advisory' AND objid = 4747 AND pid = pg_backend_pid()`))
      assert.deepEqual(mine.rows, [{ n: 1 }], 'b kept its backend, and its lock')
      assert.deepEqual(b.errors, [], 'b was not closed')
      await b.query('SELECT pg_advisory_unlock(4747)')
    } finally {
      await Promise.all([a, b].map((x) => x.end().catch(() => {})))
      await p.close()
      await relay.close()
    }
  })
}

test('a session idle inside a transaction past --idle-in-transaction-timeout ends with 25P03, its transaction rolled back, its backend lent on', async () => {
  const p = await proxy({ size: 1, timeoutMs: 3000, idleInTransactionMs: 300 })
  const [idle, next] = await Promise.all([session(p), session(p)])
  try {
    await idle.query('BEGIN')
    await idle.query(`INSERT INTO ${scratch.name} VALUES (1)`)
    // The other session waits for the only backend, which comes free when the idle one is ended.
    assert.deepEqual((await next.query(`SELECT count(*)::int AS n FROM ${scratch.name}`)).rows, [{ n: 0 }], 'rolled back')
    await eventually(async () => idle.errors.length > 0, 'the idle session to be told')
    assert.equal((idle.errors[0] as Error & { code?: string }).code, '25P03')
    assert.match(idle.errors[0].message, /idle-in-transaction timeout.*--idle-in-transaction-timeout 300 ms/)
    // A transaction that keeps working is not idle: statements 200 ms apart, 1.2 s in all.
    await next.query('BEGIN')
    for (let i = 0; i < 6; i++) await new Promise((r) => setTimeout(r, 200)).then(() => next.query('SELECT 1'))
    await next.query('COMMIT')
    assert.deepEqual(next.errors, [])
  } finally {
    await Promise.all([idle, next].map((x) => x.end().catch(() => {})))
    await p.close()
  }
})

test("by default a small pool (3 backends, as a worker's part of --pool-size 5) lets two sessions keep state at once, and others still run", async () => {
  const p = await proxy({ size: 3, maxPerClient: 3 })
  const [a, b, c] = await Promise.all([session(p), session(p), session(p)])
  try {
    await a.query('CREATE TEMP TABLE kept_a (x int)')
    await b.query('CREATE TEMP TABLE kept_b (x int)')
    assert.deepEqual(await outcome(c, 'SELECT 3 AS three'), { rows: [{ three: 3 }] })
    assert.deepEqual([...a.errors, ...b.errors], [])
    assert.deepEqual((await b.query('SELECT count(*)::int AS n FROM kept_b')).rows, [{ n: 0 }], 'b keeps its table')
  } finally {
    await Promise.all([a, b, c].map((x) => x.end().catch(() => {})))
    await p.close()
  }
})

test('a backend given back while every waiting client is past its share still serves one of them (no backend idle while sessions wait)', async () => {
  const p = await proxy({ size: 3, maxPerClient: 1 })
  const [a1, a2, a3] = await Promise.all([session(p, true), session(p, true), session(p, true)])
  const [b1, b2] = await Promise.all([session(p), session(p)])
  try {
    for (const c of [a1, a2, b1]) await c.query('BEGIN') // all three backends, each taken while no one waited
    const a3Ran = outcome(a3, 'SELECT 3 AS three') // waits: its client holds 2 of a share of 1
    await eventually(async () => (await waiting(p)) === 1, 'a3 to wait')
    const b2Ran = outcome(b2, 'SELECT 4 AS four') // waits: its client holds 1 of 1
    await eventually(async () => (await waiting(p)) === 2, 'b2 to wait')
    await a1.query('COMMIT')
    assert.deepEqual(await a3Ran, { rows: [{ three: 3 }] }, 'served by the backend a1 gave back, not 53300 after --pool-timeout')
    await b1.query('COMMIT')
    assert.deepEqual(await b2Ran, { rows: [{ four: 4 }] })
  } finally {
    await Promise.all([a1, a2, a3, b1, b2].map((c) => c.end().catch(() => {})))
    await p.close()
  }
})
