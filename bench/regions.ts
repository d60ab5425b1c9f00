/**
 * `regions`: reads far from the database (docs/replicas.md). Delay relays on loopback: the
 * user 10 ms (RTT) from a proxy near it, the primary 90 ms beyond; a hot standby of the primary next
 * to that proxy. Paths: A (the proxy at the primary, the user 100 ms away), B (the proxy near the
 * user), B with the replica (--replica); Neon's driver through A beside them. Then stale reads: write
 * then read pairs, over two Clients of one process, against the replica made to lag 300 ms.
 */
import net from 'node:net'
import { spawn } from 'node:child_process'
import { fileURLToPath } from 'node:url'
import { WebSocket, WebSocketServer } from 'ws'
import { Client as NeonClient, neon, neonConfig } from '@neondatabase/serverless'
import { Client, httpSql } from '../src/index'
import { createProxy } from '../proxy/index'
import { startDelayRelay } from '../test/support/delay-relay'
import { startPostgres, PASSWORD } from '../test/support/stack'
import { replicable, startStandby, type Standby } from '../test/support/standby'
import { median, printGrid, type Row, type Section } from './lib'

const IDLE_TIMEOUT_MS = 500
const TABLE = 'bench_regions'
const PAIRS = 1000
const AT_ONCE = 50
/** Runs of each operation (the median is shown), after WARMUP fresh Clients. */
const RUNS = 15
const WARMUP = 5

export const regions: Section = {
  name: 'regions',
  async run() {
    const primary = await startPostgres(replicable({ name: 'bench-regions' }))
    const standby = await startStandby(primary, 'bench-regions-standby')
    const admin = primary.admin()
    const rows: Row[] = []
    await admin.connect()
    try {
      await admin.query(`CREATE TABLE ${TABLE} (id int PRIMARY KEY, n int NOT NULL); INSERT INTO ${TABLE} SELECT g, 0 FROM generate_series(1, ${AT_ONCE}) g`)
      await standby.caughtUp()
      let runtimes: Record<string, { fresh: number; warm: number }> = {}
      const paths = {
        A: await path(primary.port, standby, 100, 0, false),
        B: await path(primary.port, standby, 10, 90, false),
        'B with the replica': await path(primary.port, standby, 10, 90, true, async (ws, url) => void (runtimes = await fromRuntimes(ws, url))),
        "Neon's driver through A": await neonPath(primary.port, 100),
      }
      const floor = await network(10, 90)
      const ops = Object.keys(paths.A)
      const replica = paths['B with the replica']
      const over = (op: string) => replica[op] - floor[op]
      printGrid(
        'regions: reads far from the database (ms; the targets are for B with the replica)',
        ['operation', ...Object.keys(paths), 'the network alone', 'B with the replica over it', 'target'],
        ops.map((op) => [op, ...Object.values(paths).map((p) => `${p[op]}`), `${floor[op]}`, `${over(op).toFixed(1)}`, TARGETS[op]?.text ?? '']),
        [
          `Delay relays on loopback (data only); each figure the median of ${RUNS} runs (3 after idle), after ${WARMUP} fresh Clients. Role scram_user; --pool-idle-timeout ${IDLE_TIMEOUT_MS} ms, the rest default. The standby streams straight from the primary here (no delay on its link).`,
          `"The network alone" is the round trips B with the replica needs (fresh: 2 short; a write, and httpSql's transaction: 1 short + 1 long; the rest 1 short), timed as bytes echoed through the same delay relays (median of 15): a short round trip measures ${floor.short} ms, a short and a long ${floor.long} ms.`,
        ]
      )
      printGrid(
        'regions: a fresh Client\'s first read and a warm read in each runtime, B with the replica (ms)',
        ['runtime', 'fresh Client, first read', 'over the network', 'warm read', 'over the network'],
        Object.entries({ ...runtimes, 'the floor: a bare ws server, Node (ws)': await bareWebSocket(10) }).map(([name, r]) => [name, r.fresh.toFixed(1), (r.fresh - floor['fresh Client, first read']).toFixed(1), r.warm.toFixed(1), (r.warm - floor['warm read']).toFixed(1)]),
        [`Each runtime runs bench/regions-client.mjs on the built bundle (median of ${RUNS}, after 5 fresh Clients), after a write of its own: each fresh Client tells the position with its query, as a request carrying config.lastWrite in a cookie would. Node's WebSocket is the \`ws\` package; Bun's and Deno's are their own. The floor: a WebSocket server of \`ws\` in this process, near the user, answering the upgrade with a message the size of a login's answer and each message with one the size of a row's: no login, no proxy, no Postgres.`]
      )
      const bare = await bareRelay(primary.port, standby, 10, 90)
      printGrid(
        'regions: the floor under a warm read and a write, a bare WebSocket relay in the proxy\'s place (ms)',
        ['operation', 'through a bare relay', 'over the network', 'B with the replica over it'],
        (['warm read', 'write'] as const).map((op) => [op, bare[op].toFixed(1), (bare[op] - floor[op]).toFixed(1), over(op).toFixed(1)]),
        [`A WebSocket-to-TCP relay of \`ws\` in this process, near the user (as bench/ws-relay.ts: no login of its own, no pool, no routing), to the standby for the read and across the 90 ms link to the primary for the write; edgepg's Client, logged in through it in band. Median of ${RUNS}. What it takes over the network is what any proxy in Node takes there, before doing anything of its own.`]
      )
      rows.push(
        ...Object.entries(TARGETS).map(([op, t]): Row => ({
          metric: `regions: ${op}, B with the replica, ms over ${t.floor}`,
          edgepg: `${replica[op]} ms`,
          baseline: `${floor[op]} ms`,
          ratio: replica[op] - (t.floor === 'the network alone' ? floor[op] : floor.long),
          target: t.allowance,
        }))
      )
      const stale = await staleReads(primary.port, standby)
      printGrid('regions: stale reads, each a write then a read by another Client of the process', ['replica lag', 'pairs', 'stale reads', 'reads on the replica', 'reads on the primary', 'mean pair (ms)'], [stale])
      rows.push({ metric: `regions: stale reads of ${PAIRS} write-then-read pairs, the replica lagging 300 ms`, edgepg: stale[2], baseline: '0', ratio: Number(stale[2]), target: 0 })
    } finally {
      await admin.end()
      await standby.stop()
      await primary.stop()
    }
    return rows
  },
}

/** The targets for B with the replica: what the op may take over its round trips, or over a short and a long one. */
const TARGETS: Record<string, { text: string; floor: 'the network alone' | 'a short and a long round trip'; allowance: number }> = {
  'fresh Client, first read': { text: '2 short + 5', floor: 'the network alone', allowance: 5 },
  'warm read': { text: '1 short + 2', floor: 'the network alone', allowance: 2 },
  write: { text: '1 short + 1 long', floor: 'the network alone', allowance: 0 },
  'read right after a write': { text: '≤ 1 short + 1 long', floor: 'a short and a long round trip', allowance: 0 },
}

/** Which round trips each operation takes in B with the replica. */
const ROUND_TRIPS: Record<string, 'short' | 'long' | 'twice short'> = {
  'fresh Client, first read': 'twice short',
  'warm read': 'short',
  write: 'long',
  'read right after a write': 'short',
  'httpSql read': 'short',
  'httpSql transaction (UPDATE, SELECT)': 'long',
  "fresh Client's first read after idle": 'twice short',
}

/** The round trips of B with the replica timed through the delay relays alone (bytes echoed back): each operation's floor, in ms. */
async function network(userMs: number, dbMs: number): Promise<Record<string, number>> {
  const echo = net.createServer((s) => s.setNoDelay(true).on('data', (d) => s.write(d)))
  await new Promise<void>((resolve) => echo.listen(0, '127.0.0.1', resolve))
  const far = await startDelayRelay({ host: '127.0.0.1', port: (echo.address() as net.AddressInfo).port }, dbMs / 2)
  const near = await startDelayRelay({ host: '127.0.0.1', port: (echo.address() as net.AddressInfo).port }, userMs / 2)
  const farther = await startDelayRelay({ host: '127.0.0.1', port: far.port }, userMs / 2)
  const rtt = async (port: number) => {
    const s = net.connect({ host: '127.0.0.1', port, noDelay: true })
    await new Promise((resolve) => s.once('connect', resolve))
    const runs: number[] = []
    for (let i = 0; i < 15; i++) {
      const t0 = performance.now()
      s.write('x')
      await new Promise((resolve) => s.once('data', resolve))
      runs.push(performance.now() - t0)
    }
    s.destroy()
    return median(runs)
  }
  try {
    const [short, long] = [await rtt(near.port), await rtt(farther.port)]
    const round = (x: number) => Math.round(x * 10) / 10
    const of = { short, long, 'twice short': 2 * short }
    return { short: round(short), long: round(long), ...Object.fromEntries(Object.entries(ROUND_TRIPS).map(([op, trips]) => [op, round(of[trips])])) }
  } finally {
    await Promise.all([far.close(), near.close(), farther.close()])
    echo.close()
  }
}

/** A bare WebSocket relay `userMs` RTT from the client: warm reads through it on the standby, and writes on the primary `dbMs` beyond it, medians in ms. */
async function bareRelay(pgPort: number, standby: Standby, userMs: number, dbMs: number): Promise<{ 'warm read': number; write: number }> {
  const far = await startDelayRelay({ host: '127.0.0.1', port: pgPort }, dbMs / 2)
  const wss = new WebSocketServer({ port: 0, host: '127.0.0.1', perMessageDeflate: false, handleProtocols: () => false })
  await new Promise((resolve) => wss.once('listening', resolve))
  wss.on('connection', (ws, req) => {
    req.socket.setNoDelay(true)
    const to = new URL(req.url!, 'ws://x').searchParams.get('port')
    const upstream = net.connect({ host: '127.0.0.1', port: Number(to), noDelay: true })
    ws.on('message', (data: Buffer) => upstream.write(data))
    upstream.on('data', (chunk) => ws.send(chunk))
    upstream.on('close', () => ws.close(1000))
    upstream.on('error', () => ws.terminate())
    ws.on('close', () => upstream.destroy())
  })
  const near = await startDelayRelay({ host: '127.0.0.1', port: (wss.address() as net.AddressInfo).port }, userMs / 2)
  const through = async (port: number, sql: string) => {
    const c = new Client({ host: '127.0.0.1', port, user: 'scram_user', password: PASSWORD, database: 'postgres', webSocketConstructor: WebSocket as any, wsProxy: () => `ws://127.0.0.1:${near.port}/?port=${port}` })
    await c.connect()
    try {
      await c.query(sql)
      return await medianOf(RUNS, () => time(() => c.query(sql)))
    } finally {
      await c.end()
    }
  }
  try {
    return { 'warm read': await through(standby.port, select), write: await through(far.port, update) }
  } finally {
    await near.close()
    await far.close()
    wss.close()
  }
}

/** The floor under a fresh read and a warm one: a bare WebSocket server `userMs` RTT away (see the runtimes table's note), medians in ms. */
async function bareWebSocket(userMs: number): Promise<{ fresh: number; warm: number }> {
  const wss = new WebSocketServer({ port: 0, host: '127.0.0.1', perMessageDeflate: false, handleProtocols: (offered) => [...offered][0] ?? false })
  await new Promise((resolve) => wss.once('listening', resolve))
  wss.on('connection', (ws) => (ws.send(Buffer.alloc(400)), ws.on('message', () => ws.send(Buffer.alloc(60)))))
  const near = await startDelayRelay({ host: '127.0.0.1', port: (wss.address() as net.AddressInfo).port }, userMs / 2)
  const answer = (ws: WebSocket) => new Promise((resolve) => ws.once('message', resolve))
  const fresh: number[] = []
  const warm: number[] = []
  try {
    for (let i = 0; i < WARMUP + RUNS; i++) {
      const t0 = performance.now()
      const ws = new WebSocket(`ws://127.0.0.1:${near.port}/v2`, ['edgepg.v5'])
      await answer(ws)
      ws.send(Buffer.alloc(14))
      await answer(ws)
      const t1 = performance.now()
      ws.send(Buffer.alloc(14))
      await answer(ws)
      if (i >= WARMUP) fresh.push(t1 - t0), warm.push(performance.now() - t1)
      ws.close()
      await new Promise((resolve) => ws.once('close', resolve))
    }
    return { fresh: median(fresh), warm: median(warm) }
  } finally {
    await near.close()
    wss.close()
  }
}

const select = `SELECT n FROM ${TABLE} WHERE id = 1`
const update = `UPDATE ${TABLE} SET n = n + 1 WHERE id = 1`

async function time(fn: () => Promise<unknown>): Promise<number> {
  const t0 = performance.now()
  await fn()
  return Math.round((performance.now() - t0) * 10) / 10
}

/** The median of `n` runs of `fn`, in ms. */
async function medianOf(n: number, fn: () => Promise<number>): Promise<number> {
  const runs: number[] = []
  for (let i = 0; i < n; i++) runs.push(await fn())
  return runs.sort((a, b) => a - b)[n >> 1]
}

/** A proxy `userMs` RTT from the client and `dbMs` from the primary, with the standby next to it or not: each operation's ms (then `also`, given the proxy's URL and a connection string). */
async function path(pgPort: number, standby: Standby, userMs: number, dbMs: number, replica: boolean, also?: (ws: string, url: string) => Promise<void>): Promise<Record<string, number>> {
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
    const out = await operations(() => new Client(config), sql)
    await also?.(config.wsProxy(), `postgresql://scram_user:${encodeURIComponent(PASSWORD)}@${upstream}/postgres`)
    return out
  } finally {
    await proxy.close()
    await front.close()
    await dbRelay?.close()
  }
}

const root = fileURLToPath(new URL('..', import.meta.url))
const RUNTIMES: Record<string, string[]> = {
  'Node (ws)': [process.execPath, 'bench/regions-client.mjs'],
  Bun: ['node_modules/.bin/bun', 'bench/regions-client.mjs'],
  Deno: ['node_modules/.bin/deno', 'run', '--allow-net', '--allow-read', '--allow-env', 'bench/regions-client.mjs'],
}

/** bench/regions-client.mjs in each runtime, through the proxy at `ws`: its medians, in ms. */
async function fromRuntimes(ws: string, url: string): Promise<Record<string, { fresh: number; warm: number }>> {
  const out: Record<string, { fresh: number; warm: number }> = {}
  for (const [name, [cmd, ...args]] of Object.entries(RUNTIMES)) {
    const child = spawn(cmd, [...args, ws, url, select, update, String(RUNS)], { cwd: root })
    let stdout = ''
    let stderr = ''
    child.stdout.on('data', (d) => (stdout += d))
    child.stderr.on('data', (d) => (stderr += d))
    const code = await new Promise((resolve) => child.on('close', resolve))
    if (code !== 0) throw new Error(`bench regions: ${name} exited ${code}: ${stderr.trim()}`)
    out[name] = JSON.parse(stdout.trim().split('\n').at(-1)!)
  }
  return out
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
  for (let i = 0; i < WARMUP; i++) await fresh() // (the key's first logins, the primary's and a replica's; then code warmed up, as in a proxy that has served a while)
  out['fresh Client, first read'] = await medianOf(RUNS, fresh)
  const c = client()
  await c.connect()
  await c.query(select)
  out['warm read'] = await medianOf(RUNS, () => time(() => c.query(select)))
  out.write = await medianOf(RUNS, () => time(() => c.query(update)))
  out['read right after a write'] = await medianOf(RUNS, async () => (await c.query(update), await time(() => c.query(select))))
  await c.end()
  await sql.query(select)
  out['httpSql read'] = await medianOf(RUNS, () => time(() => sql.query(select)))
  out['httpSql transaction (UPDATE, SELECT)'] = await medianOf(RUNS, () => time(() => sql.transaction([sql.query(update), sql.query(select)])))
  out["fresh Client's first read after idle"] = await medianOf(3, async () => (await new Promise((r) => setTimeout(r, 3 * IDLE_TIMEOUT_MS)), await fresh()))
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
