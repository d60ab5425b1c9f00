import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import pg from 'pg'
import Cursor from 'pg-cursor'
import { edgeConfig, startProxy, pgConfig, recordingWebSocket, tags } from './support/helpers'
import { Client } from '../src/index'

/** What a query settled to, comparable across drivers. */
const settle = (p: Promise<pg.QueryResult>) =>
  p.then(
    (r) => ({ rows: r.rows, command: r.command, rowCount: r.rowCount }),
    (e) => ({ error: e.code ?? e.message })
  )

let proxy: Awaited<ReturnType<typeof startProxy>>
before(async () => (proxy = await startProxy()))
after(() => proxy.close())

async function warmClient(extra = {}) {
  const rec = recordingWebSocket()
  const client = new Client(edgeConfig(proxy.port, 'scram_user', { webSocketConstructor: rec.Recording, ...extra }))
  await client.connect()
  await client.query('SELECT 1')
  rec.sent.length = 0
  return { client, sent: rec.sent }
}

test('concurrent queries leave together in one message, and results keep their order', async () => {
  const { client, sent } = await warmClient()
  const results = await Promise.all(Array.from({ length: 10 }, (_, i) => client.query('SELECT $1::int AS i, pg_sleep(0.01)', [i])))
  assert.deepEqual(results.map((r) => r.rows[0].i), [0, 1, 2, 3, 4, 5, 6, 7, 8, 9])
  assert.equal(sent.length, 1, 'all ten queries in one WebSocket message')
  assert.equal(tags(sent[0]), 'PBDES'.repeat(10))
  await client.end()
})

test('an error fails only its own query; transactions behave as over pg sequentially', async () => {
  const { client } = await warmClient()
  const tcp = new pg.Client(pgConfig())
  await tcp.connect()
  const batch = (c: pg.Client) => [
    settle(c.query('SELECT 1 AS a')),
    settle(c.query('SELECT 1/0')),
    settle(c.query('SELECT $1::text AS b', ['after the error'])),
    settle(c.query('CREATE TEMP TABLE IF NOT EXISTS pipe_t (x int)')),
    settle(c.query('BEGIN')),
    settle(c.query('INSERT INTO pipe_t VALUES (1), (2)')),
    settle(c.query('SAVEPOINT s')),
    settle(c.query('INSERT INTO pipe_t VALUES (NULL::text::int / 0)')),
    settle(c.query('ROLLBACK TO SAVEPOINT s')),
    settle(c.query('INSERT INTO pipe_t VALUES ($1)', [3])),
    settle(c.query('SELECT nonsense')),
    settle(c.query('SELECT count(*)::int AS n FROM pipe_t')), // aborted transaction: 25P02
    settle(c.query('ROLLBACK')),
    settle(c.query('SELECT count(*)::int AS n FROM pipe_t')),
  ]
  const viaEdge = await Promise.all(batch(client))
  const viaPg = await Promise.all(batch(tcp))
  assert.deepEqual(viaEdge, viaPg)
  assert.deepEqual(viaEdge[1], { error: '22012' })
  assert.deepEqual(viaEdge[11], { error: '25P02' })
  assert.deepEqual(viaEdge[13], { rows: [{ n: 0 }], command: 'SELECT', rowCount: 1 })
  await client.end()
  await tcp.end()
})

test('a cursor waits for the line to clear and runs alone; plain queries around it stay correct', async () => {
  const { client, sent } = await warmClient()
  const before = [client.query('SELECT 1 AS n'), client.query('SELECT 2 AS n')]
  const cursor = client.query(new Cursor('SELECT g FROM generate_series(1, 5) g'))
  const after = client.query('SELECT 3 AS n')
  const read = (n: number) => new Promise<any[]>((res, rej) => cursor.read(n, (err: Error | undefined, rows: any[]) => (err ? rej(err) : res(rows))))
  assert.deepEqual((await Promise.all(before)).map((r) => r.rows[0].n), [1, 2])
  assert.deepEqual((await read(2)).map((r) => r.g), [1, 2])
  assert.deepEqual((await read(10)).map((r) => r.g), [3, 4, 5])
  await new Promise<void>((res) => cursor.close(() => res()))
  assert.deepEqual((await after).rows, [{ n: 3 }])
  // The two plain queries (simple protocol, 'Q') left together; the cursor's Parse/Bind/Describe,
  // its Executes and its Close each went alone, and the query issued after it waited for its Close.
  assert.deepEqual(sent.map(tags), ['QQ', 'PBDH', 'EH', 'EH', 'CS', 'Q'])
  await client.end()
})

test('pipeline: false sends each query only after the previous one is answered', async () => {
  const { client, sent } = await warmClient({ pipeline: false })
  const results = await Promise.all([1, 2, 3].map((i) => client.query('SELECT $1::int AS i', [i])))
  assert.deepEqual(results.map((r) => r.rows[0].i), [1, 2, 3])
  assert.deepEqual(sent.map(tags), ['PBDES', 'PBDES', 'PBDES'])
  await client.end()
})

test("a portal's Close sent once its error is in (as pg-cursor's is when destroyed then): Postgres skips it, and the next queries get their own answers", async () => {
  const { client } = await warmClient()
  // A Submittable that runs a portal, and closes it (Close, Sync) only after its ErrorResponse is in.
  const failing = {
    submit(con: any) {
      con.parse({ text: 'SELECT relname, 1/0 FROM pg_class' }, true)
      con.bind({ portal: 'p' }, true)
      con.describe({ type: 'P', name: 'p' }, true)
      con.execute({ portal: 'p', rows: 100 }, true)
      con.flush()
      this.con = con
    },
    handleError(err: Error) {
      this.con.once('readyForQuery', () => this.callback(err))
      this.con.close({ type: 'P', name: 'p' }, true)
      this.con.sync()
    },
    handleReadyForQuery() {},
    handleRowDescription() {},
    handleDataRow() {},
    handleCommandComplete() {},
    handleEmptyQuery() {},
    handlePortalSuspended() {},
  } as any
  const pinned = async () => (await proxy.metrics.registry.getSingleMetric('edgepg_proxy_pinned_sessions_total')!.get()).values.reduce((n, v) => n + v.value, 0)
  const pinnedBefore = await pinned()
  const err = await new Promise<Error & { code?: string }>((resolve) => client.query(Object.assign(failing, { callback: resolve })))
  assert.equal(err.code, '22012')
  for (const word of ['one', 'two', 'three']) assert.deepEqual((await client.query('SELECT $1::text AS word', [word])).rows, [{ word }])
  assert.equal(await pinned(), pinnedBefore, 'not pinned as unverified')
  await client.end()
})
