/**
 * `regions`: reads far from the database (README, "Read replicas"). Delay relays on loopback: the
 * user 10 ms (RTT) from a proxy near it, the primary 90 ms beyond; a hot standby of the primary next
 * to that proxy. Paths: A (the proxy at the primary, the user 100 ms away), B (the proxy near the
 * user), B with the replica (--replica); Neon's driver through A beside them. Then stale reads: write
 * then read pairs, over two Clients of one process, against the replica made to lag 300 ms.
 */
import pg from 'pg'
import { WebSocket } from 'ws'
import { Client as NeonClient, neon, neonConfig } from '@neondatabase/serverless'
import { Client, httpSql } from '../src/index'
import { createProxy } from '../proxy/index'
import { startDelayRelay } from '../test/support/delay-relay'
import { startPostgres, PASSWORD } from '../test/support/stack'
import { replicable, startStandby, type Standby } from '../test/support/standby'
import { printGrid, type Section } from './lib'

const IDLE_TIMEOUT_MS = 500
const TABLE = 'bench_regions'
const PAIRS = 1000
const AT_ONCE = 50

export const regions: Section = {
  name: 'regions',
  async run() {
    const primary = await startPostgres(replicable({ name: 'bench-regions' }))
    const standby = await startStandby(primary, 'bench-regions-standby')
    const admin = primary.admin()
    await admin.connect()
    try {
      await admin.query(`CREATE TABLE ${TABLE} (id int PRIMARY KEY, n int NOT NULL); INSERT INTO ${TABLE} SELECT g, 0 FROM generate_series(1, ${AT_ONCE}) g`)
      await standby.caughtUp()
      const paths = {
        A: await path(primary.port, standby, 100, 0, false),
        B: await path(primary.port, standby, 10, 90, false),
        'B with the replica': await path(primary.port, standby, 10, 90, true),
        "Neon's driver through A": await neonPath(primary.port, 100),
      }
      const ops = Object.keys(paths.A)
      printGrid(
        'regions: reads far from the database (ms; targets for B with the replica in the last column)',
        ['operation', ...Object.keys(paths), 'target'],
        ops.map((op) => [op, ...Object.values(paths).map((p) => (p[op] === undefined ? '–' : `${p[op]}`)), TARGETS[op] ?? '']),
        [`Delay relays on loopback (data only). Role scram_user; --pool-idle-timeout ${IDLE_TIMEOUT_MS} ms, the rest default. The standby streams straight from the primary here (no delay on its link).`]
      )
      const stale = await staleReads(primary.port, standby)
      printGrid('regions: stale reads, each a write then a read by another Client of the process', ['replica lag', 'pairs', 'stale reads', 'reads on the replica', 'reads on the primary', 'mean pair (ms)'], [stale])
    } finally {
      await admin.end()
      await standby.stop()
      await primary.stop()
    }
    return []
  },
}

const TARGETS: Record<string, string> = {
  'fresh Client, first read': '≤ 25 (2 short + 5)',
  'warm read': '≤ 12 (1 short + 2)',
  write: '≤ 100 (1 short + 1 long)',
  'read right after a write': '≤ 100 (1 short + 1 long)',
}

const select = `SELECT n FROM ${TABLE} WHERE id = 1`
const update = `UPDATE ${TABLE} SET n = n + 1 WHERE id = 1`

async function time(fn: () => Promise<unknown>): Promise<number> {
  const t0 = performance.now()
  await fn()
  return Math.round(performance.now() - t0)
}

/** The median of `n` runs of `fn`, in ms. */
async function median(n: number, fn: () => Promise<number>): Promise<number> {
  const runs: number[] = []
  for (let i = 0; i < n; i++) runs.push(await fn())
  return runs.sort((a, b) => a - b)[n >> 1]
}

/** A proxy `userMs` RTT from the client and `dbMs` from the primary, with the standby next to it or not: each operation's ms. */
async function path(pgPort: number, standby: Standby, userMs: number, dbMs: number, replica: boolean): Promise<Record<string, number>> {
  const dbRelay = dbMs ? await startDelayRelay({ host: '127.0.0.1', port: pgPort }, dbMs / 2) : undefined
  const upstream = `127.0.0.1:${dbRelay?.port ?? pgPort}`
  const proxy = createProxy({
    upstream,
    pool: { idleTimeoutMs: IDLE_TIMEOUT_MS },
    ...(replica && { replicas: { addresses: [`127.0.0.1:${standby.port}`], maxLagMs: 5000, waitMs: 200, autocommit: true } }),
  })
  const { port } = await proxy.listen(0, '127.0.0.1')
  const front = await startDelayRelay({ host: '127.0.0.1', port }, userMs / 2)
  const [host, upPort] = upstream.split(':')
  const config = { host, port: Number(upPort), user: 'scram_user', password: PASSWORD, database: 'postgres', webSocketConstructor: WebSocket as any, wsProxy: () => `ws://127.0.0.1:${front.port}/v2` }
  const sql = httpSql(`postgresql://scram_user:${PASSWORD}@${upstream}/postgres`, { fetchEndpoint: `http://127.0.0.1:${front.port}/sql` })
  try {
    return await operations(() => new Client(config), sql)
  } finally {
    await proxy.close()
    await front.close()
    await dbRelay?.close()
  }
}

interface Queries {
  query(text: string): Promise<unknown>
}
interface Sql extends Queries {
  transaction(queries: unknown[]): Promise<unknown>
}

/** Each operation's ms, with Clients from `client`, and `sql` for httpSql (edgepg's, or Neon's). */
async function operations(client: () => Queries & { connect(): Promise<unknown>; end(): Promise<unknown> }, sql: Sql): Promise<Record<string, number>> {
  const fresh = async () => {
    const c = client()
    const ms = await time(async () => (await c.connect(), await c.query(select)))
    await c.end()
    return ms
  }
  const out: Record<string, number> = {}
  await fresh() // (the key's first logins: the primary's, and a replica's)
  await fresh()
  out['fresh Client, first read'] = await median(3, fresh)
  const c = client()
  await c.connect()
  await c.query(select)
  out['warm read'] = await median(5, () => time(() => c.query(select)))
  out.write = await median(5, () => time(() => c.query(update)))
  out['read right after a write'] = await median(5, async () => (await c.query(update), await time(() => c.query(select))))
  await c.end()
  await sql.query(select)
  out['httpSql read'] = await median(5, () => time(() => sql.query(select)))
  out['httpSql transaction (UPDATE, SELECT)'] = await median(5, () => time(() => sql.transaction([sql.query(update), sql.query(select)])))
  await new Promise((r) => setTimeout(r, 3 * IDLE_TIMEOUT_MS))
  out["fresh Client's first read after idle"] = await fresh()
  return out
}

/** @neondatabase/serverless (its Client and neon()) through A: the proxy at the primary, the user `userMs` away. */
async function neonPath(pgPort: number, userMs: number): Promise<Record<string, number>> {
  const proxy = createProxy({ upstream: `127.0.0.1:${pgPort}`, pool: { idleTimeoutMs: IDLE_TIMEOUT_MS } })
  const { port } = await proxy.listen(0, '127.0.0.1')
  const front = await startDelayRelay({ host: '127.0.0.1', port }, userMs / 2)
  const client = () => {
    const c = new NeonClient({ host: '127.0.0.1', port: pgPort, user: 'scram_user', password: PASSWORD, database: 'postgres' })
    Object.assign(c.neonConfig, { webSocketConstructor: WebSocket, wsProxy: `127.0.0.1:${front.port}/v1`, useSecureWebSocket: false, forceDisablePgSSL: true, pipelineConnect: 'password' })
    return c
  }
  neonConfig.fetchEndpoint = `http://127.0.0.1:${front.port}/sql`
  const sql = neon(`postgresql://scram_user:${PASSWORD}@127.0.0.1:${pgPort}/postgres`)
  try {
    return await operations(client, sql as unknown as Sql)
  } finally {
    await proxy.close()
    await front.close()
  }
}

/** PAIRS write-then-read pairs (AT_ONCE at a time, a row each), each read by another Client than its write, through B with the replica lagging 300 ms. */
async function staleReads(pgPort: number, standby: Standby): Promise<string[]> {
  await standby.delay(300)
  const dbRelay = await startDelayRelay({ host: '127.0.0.1', port: pgPort }, 45)
  const upstream = `127.0.0.1:${dbRelay.port}`
  const proxy = createProxy({ upstream, replicas: { addresses: [`127.0.0.1:${standby.port}`], maxLagMs: 5000, waitMs: 1000, autocommit: true } })
  const { port } = await proxy.listen(0, '127.0.0.1')
  const front = await startDelayRelay({ host: '127.0.0.1', port }, 5)
  const config = { host: '127.0.0.1', port: dbRelay.port, user: 'scram_user', password: PASSWORD, database: 'postgres', webSocketConstructor: WebSocket as any, wsProxy: () => `ws://127.0.0.1:${front.port}/v2` }
  const count = async (target: string) => Number(new RegExp(`transactions_total\\{target="${target}"\\} (\\d+)`).exec(await proxy.metrics.registry.metrics())?.[1] ?? 0)
  let stale = 0
  const t0 = performance.now()
  try {
    const [replicaBefore, primaryBefore] = [await count('replica'), await count('primary')]
    await Promise.all(
      Array.from({ length: AT_ONCE }, async (_, i) => {
        const [writer, reader] = [new Client(config), new Client(config)]
        await Promise.all([writer.connect(), reader.connect()])
        for (let k = 0; k < PAIRS / AT_ONCE; k++) {
          const written = (await writer.query(`UPDATE ${TABLE} SET n = n + 1 WHERE id = $1 RETURNING n`, [i + 1])).rows[0].n
          const read = (await reader.query(`SELECT n FROM ${TABLE} WHERE id = $1`, [i + 1])).rows[0].n
          if (read < written) stale++
        }
        await Promise.all([writer.end(), reader.end()])
      })
    )
    const ms = Math.round(((performance.now() - t0) / PAIRS) * AT_ONCE)
    const replicaReads = (await count('replica')) - replicaBefore
    return ['300 ms', String(PAIRS), String(stale), String(replicaReads), String((await count('primary')) - primaryBefore - PAIRS), String(ms)]
  } finally {
    await proxy.close()
    await front.close()
    await dbRelay.close()
    await standby.delay(0)
  }
}
