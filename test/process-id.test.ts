/**
 * processID in transaction pooling means the session: each is told one no backend has, and
 * pg_cancel_backend / pg_terminate_backend on it, from that session or another of the same role,
 * act as on one connection: the first stops that session's running statement and nothing else, the
 * second ends that session and no other. As Kysely's abort strategies use them, with two sessions
 * busy at once, and across --workers.
 */
import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { Kysely, PostgresDialect, sql } from 'kysely'
import type { Client } from '../src/index'
import { startProxy, edgeClient, edgePool, scratchTable, eventually, within } from './support/helpers'
import { startChildProxy } from './support/child-proxy'
import { testPostgres } from './support/helpers'

let scratch: Awaited<ReturnType<typeof scratchTable>>
before(async () => (scratch = await scratchTable('process_id', 'who text')))
after(() => scratch?.drop())

const proxy = () => startProxy({ pool: { mode: 'transaction', size: 4, maxPerClient: 4, timeoutMs: 3000 } })

async function session(port: number): Promise<Client & { errors: Array<Error & { code?: string }> }> {
  const client = Object.assign(edgeClient(port, 'scram_user'), { errors: [] as Array<Error & { code?: string }> })
  client.on('error', (err) => client.errors.push(err))
  await client.connect()
  return client
}
const pidOf = (c: Client) => (c as unknown as { processID: number }).processID
const rows = async () => (await scratch.tcp.query(`SELECT who FROM ${scratch.name} ORDER BY who`)).rows.map((r) => r.who)
/** Until the session's statement runs at Postgres. */
const running = (who: string) =>
  eventually(async () => (await scratch.tcp.query("SELECT 1 FROM pg_stat_activity WHERE state = 'active' AND query LIKE $1", [`%'${who}'%pg_sleep%`])).rows.length === 1, `${who}'s statement to run`)

test('each session is told a processID of its own, which no backend has', async () => {
  const p = await proxy()
  const clients = await Promise.all([session(p.port), session(p.port), session(p.port)])
  try {
    const told = clients.map(pidOf)
    assert.equal(new Set(told).size, 3)
    const backends = (await scratch.tcp.query('SELECT pid FROM pg_stat_activity')).rows.map((r) => r.pid)
    assert.deepEqual(told.filter((pid) => backends.includes(pid)), [])
  } finally {
    await Promise.all(clients.map((c) => c.end()))
    await p.close()
  }
})

test("pg_cancel_backend(processID) stops that session's statement only; pg_terminate_backend(processID) ends that session only", async () => {
  const p = await proxy()
  const [a, b, c] = await Promise.all([session(p.port), session(p.port), session(p.port)])
  try {
    // a holds a transaction with a write while b's write sleeps; c signals b (by a constant, then by a parameter).
    await a.query('BEGIN')
    await a.query(`INSERT INTO ${scratch.name} VALUES ('a')`)
    const slow = b.query(`INSERT INTO ${scratch.name} SELECT 'b' FROM pg_sleep(5)`).then(() => 'done', (err) => err.code)
    await running('b')
    await c.query(`SELECT pg_cancel_backend(${pidOf(b)})`)
    assert.equal(await within(3000, "b's statement", slow), '57014')
    assert.deepEqual((await b.query('SELECT 1 AS one')).rows, [{ one: 1 }], 'b goes on')
    await a.query('COMMIT')
    assert.deepEqual(await rows(), ['a'], "a's transaction kept, b's write cancelled")

    await a.query('BEGIN')
    await a.query(`INSERT INTO ${scratch.name} VALUES ('a2')`)
    const killed = b.query(`INSERT INTO ${scratch.name} SELECT 'b2' FROM pg_sleep(5)`).then(() => 'done', (err) => err.code)
    await running('b2')
    await c.query('SELECT pg_terminate_backend($1)', [pidOf(b)])
    assert.equal(await within(3000, "b's statement", killed), '57P01')
    await eventually(async () => b.errors.length > 0, 'b to end')
    await a.query('COMMIT')
    assert.deepEqual(await rows(), ['a', 'a2'], "a's transactions kept, b's writes gone")
    assert.deepEqual((await c.query('SELECT 2 AS two')).rows, [{ two: 2 }], 'c goes on')
  } finally {
    await Promise.all([a, b, c].map((x) => x.end().catch(() => {})))
    await p.close()
    await scratch.tcp.query(`DELETE FROM ${scratch.name}`)
  }
})

test('a signal reaches its session when Postgres runs the signalling statement, not when the proxy passes it on', async () => {
  const p = await proxy()
  const [b, c] = await Promise.all([session(p.port), session(p.port)])
  try {
    const killed = b.query(`SELECT 'b3', pg_sleep(5)`).then(() => 'done', (err) => err.code)
    await running('b3')
    // Left to right, as Postgres evaluates it: 300 ms of sleep before the terminate.
    const signalled = c.query('SELECT pg_sleep(0.3), pg_terminate_backend($1)', [pidOf(b)])
    await new Promise((resolve) => setTimeout(resolve, 150))
    assert.equal(b.errors.length, 0, 'b still runs while the signalling statement sleeps')
    await signalled
    assert.equal(await within(3000, "b's statement", killed), '57P01')
  } finally {
    await Promise.all([b, c].map((x) => x.end().catch(() => {})))
    await p.close()
  }
})

for (const strategy of ['cancel query', 'kill session'] as const) {
  test(`Kysely's '${strategy}' abort stops its own write, while another session's transaction goes on`, async () => {
    const p = await proxy()
    const other = await session(p.port)
    const pool = edgePool(p.port, { max: 3 })
    const poolErrors: string[] = []
    pool.on('error', (err) => poolErrors.push(err.message)) // (as on TCP, a killed session's client reports its connection's end)
    const db = new Kysely<any>({ dialect: new PostgresDialect({ pool }) })
    try {
      await other.query('BEGIN')
      await other.query(`INSERT INTO ${scratch.name} VALUES ('other')`)
      const write = sql`INSERT INTO ${sql.table(scratch.name)} SELECT 'aborted' FROM pg_sleep(2)`
      const err = await write.execute(db, { inflightQueryAbortStrategy: strategy, signal: AbortSignal.timeout(300) } as never).then(() => undefined, (e: Error) => e)
      assert.equal(err?.name, 'TimeoutError')
      await new Promise((resolve) => setTimeout(resolve, 2500)) // (past the write's own end, had it gone on)
      await other.query('COMMIT')
      assert.deepEqual(await rows(), ['other'])
      if (strategy === 'kill session') assert.deepEqual(poolErrors, ['Connection terminated unexpectedly'], 'as Kysely expects of pg')
    } finally {
      await db.destroy()
      await other.end()
      await p.close()
      await scratch.tcp.query(`DELETE FROM ${scratch.name}`)
    }
  })
}

test('with --workers 2, a signal reaches a session of the other worker', async () => {
  const { host, port } = testPostgres()
  const p = await startChildProxy(`${host}:${port}`, { built: true, env: { EDGEPG_WORKERS: '2' }, flags: ['--pool-size', '8', '--max-backends-per-client', '8'] })
  const clients: Awaited<ReturnType<typeof session>>[] = []
  try {
    // (Until both listen, every session goes to the first.)
    await eventually(async () => new Set(p.lines.filter((l) => l.listening).map((l) => l.pid)).size === 2, 'both workers listening', 15_000)
    // Sessions until two are on different workers (the worker is in the processID's bits above 2^24).
    const worker = (c: Client) => Math.floor((pidOf(c) - 2 ** 30) / 2 ** 24)
    for (let round = 0; round < 5 && new Set(clients.map(worker)).size < 2; round++) clients.push(...(await Promise.all(Array.from({ length: 8 }, () => session(p.port)))))
    const b = clients[0]
    const c = clients.find((x) => worker(x) !== worker(b))!
    assert.ok(c, `two sessions on different workers: ${clients.map(pidOf)}`)
    const slow = b.query(`INSERT INTO ${scratch.name} SELECT 'w' FROM pg_sleep(5)`).then(() => 'done', (err) => err.code)
    await running('w')
    await c.query(`SELECT pg_cancel_backend(${pidOf(b)})`)
    assert.equal(await within(3000, "b's statement", slow), '57014')
    assert.deepEqual(await rows(), [])
  } finally {
    await Promise.all(clients.map((x) => x.end().catch(() => {})))
    await p.stop()
  }
})
