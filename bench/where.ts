/**
 * `where`: where to put the proxy (docs/replicas.md, "Where to put the proxy"). A: next to Postgres, the
 * client 100 ms away; B: 10 ms from the client, Postgres 90 ms beyond. Delay relays on loopback
 * stand for the links (they delay data, not TCP handshakes); the same edgepg Client and httpSql on
 * both, through an in-process proxy per topology with a short --pool-idle-timeout.
 */
import pg from 'pg'
import { Client, httpSql } from '../src/index'
import { createProxy } from '../proxy/index'
import { startDelayRelay } from '../test/support/delay-relay'
import { printGrid, type BenchContext, type Section } from './lib'

const IDLE_TIMEOUT_MS = 500
const TABLE = 'bench_where'

export const where: Section = {
  name: 'where',
  async run(ctx) {
    const admin = new pg.Client(ctx.pgConfig())
    await admin.connect()
    await admin.query(`CREATE TABLE IF NOT EXISTS ${TABLE} (id int PRIMARY KEY, n int NOT NULL); INSERT INTO ${TABLE} VALUES (1, 0) ON CONFLICT DO NOTHING`)
    try {
      const a = await topology(ctx, 100, 0)
      const b = await topology(ctx, 10, 90)
      printGrid(
        'where: the proxy next to Postgres (A) or near its users (B)',
        ['operation', 'A: next to Postgres, client 100 ms away', 'B: 10 ms from the client, Postgres 90 ms beyond'],
        Object.keys(a).map((op) => [op, `${a[op]} ms`, `${b[op]} ms`]),
        [`Delay relays on loopback (data only: a real link adds TCP's handshake to a new connection). Role scram_user; --pool-idle-timeout ${IDLE_TIMEOUT_MS} ms, the rest default (--pool-keep-warm on).`]
      )
    } finally {
      await admin.query(`DROP TABLE IF EXISTS ${TABLE}`)
      await admin.end()
    }
    return []
  },
}

/** Each operation's milliseconds, with the client `clientMs` RTT from the proxy and Postgres `dbMs` beyond it. */
async function topology(ctx: BenchContext, clientMs: number, dbMs: number): Promise<Record<string, number>> {
  const dbRelay = dbMs ? await startDelayRelay(ctx.pg, dbMs / 2) : undefined
  const upstream = dbRelay ? `127.0.0.1:${dbRelay.port}` : `${ctx.pg.host}:${ctx.pg.port}`
  const proxy = createProxy({ upstream, pool: { idleTimeoutMs: IDLE_TIMEOUT_MS } })
  const { port } = await proxy.listen(0, '127.0.0.1')
  const front = await startDelayRelay({ host: '127.0.0.1', port }, clientMs / 2)
  const { user, password, database } = ctx.pgConfig()
  const [host, pgPort] = upstream.split(':')
  const config = { ...ctx.edgeConfig(), host, port: Number(pgPort), wsProxy: () => `ws://127.0.0.1:${front.port}/v2` }
  const sql = httpSql(`postgresql://${user}:${encodeURIComponent(String(password))}@${upstream}/${database}`, { fetchEndpoint: `http://127.0.0.1:${front.port}/sql` })
  const time = async (fn: () => Promise<unknown>) => {
    const t0 = performance.now()
    await fn()
    return Math.round(performance.now() - t0)
  }
  const fresh = async () => {
    const client = new Client(config)
    let connect = 0
    const first = await time(async () => {
      connect = await time(() => client.connect())
      await client.query('SELECT 1')
    })
    await client.end()
    return { connect, first }
  }
  const update = `UPDATE ${TABLE} SET n = n + 1 WHERE id = 1`
  const select = `SELECT n FROM ${TABLE} WHERE id = 1`
  const out: Record<string, number> = {}
  try {
    await fresh() // (the key's first login)
    const f = await fresh()
    out['connect() resolves'] = f.connect
    out['fresh Client, first row of SELECT 1'] = f.first
    await new Promise((r) => setTimeout(r, 3 * IDLE_TIMEOUT_MS))
    out["the same after the key's backends idled out"] = (await fresh()).first
    const client = new Client(config)
    await client.connect()
    await client.query('SELECT 1')
    out['warm query'] = await time(() => client.query('SELECT 1'))
    out['BEGIN; UPDATE; SELECT; COMMIT as one string'] = await time(() => client.query(`BEGIN; ${update}; ${select}; COMMIT`))
    out['BEGIN, UPDATE, SELECT, COMMIT awaited one by one'] = await time(async () => {
      for (const text of ['BEGIN', update, select, 'COMMIT']) await client.query(text)
    })
    await client.end()
    await sql.query('SELECT 1')
    out['httpSql, one query'] = await time(() => sql.query('SELECT 1'))
    out['httpSql, sql.transaction([UPDATE, SELECT])'] = await time(() => sql.transaction([sql.query(update), sql.query(select)]))
  } finally {
    await proxy.close()
    await front.close()
    await dbRelay?.close()
  }
  return out
}
