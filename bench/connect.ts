/**
 * Section "connect": what a new connection costs, and whether concurrent queries share round
 * trips, for edgepg vs @neondatabase/serverless vs pg over TCP, on the same stack in the same run.
 *
 * Latency runs behind a delay relay (test/support/delay-relay.ts, 25 ms each way = 50 ms RTT): in front of
 * edgepg-proxy for edgepg and Neon, in front of Postgres itself for pg over TCP, so all pay the
 * same RTT; round trips = elapsed / RTT, and a turn counter in front of each delay relay also
 * counts them exactly (bench/turn-counter.ts). Neon is measured four ways (NEON_LEGEND): through
 * edgepg-proxy, which offloads auth (so Neon's default cleartext pipelining works there), and
 * through a plain relaying proxy (edgepg-proxy --no-auth-offload, which behaves like a bare
 * wsproxy in front of Postgres), where Neon has to do md5/SCRAM itself.
 *
 * Client CPU per cold connect is measured on loopback (no delay relay), with every proxy in a
 * child process, from process.cpuUsage() around connect + first query.
 */
import { Client as NeonClient } from '@neondatabase/serverless'
import pg from 'pg'
import { WebSocket } from 'ws'
import { Client } from '../src/index'
import { startDelayRelay } from '../test/support/delay-relay'
import { PASSWORD, type Role } from '../test/support/stack'
import { gc, interleave, median, printGrid, type BenchContext, type Row, type Section } from './lib'
import { startProxy, type RunningProxy } from './proxy'
import { startTurnCounter, type TurnCounter } from './turn-counter'

const ONE_WAY_MS = 25
const RTT_MS = 2 * ONE_WAY_MS
const COLD_RUNS = 5
const WARM_ROUNDS = 5
const CONCURRENT = 10
const CPU_WARMUP = 5
const CPU_RUNS = 20
/** A connect that neither succeeds nor fails within this long is reported as hung. */
const ATTEMPT_TIMEOUT_MS = 5000

const RT_TARGET = 2
const WARM_TARGET = 1
const CPU_TARGET_MS = 5

const AUTH: { role: Role; label: string }[] = [
  { role: 'password_user', label: 'password (cleartext)' },
  { role: 'md5_user', label: 'md5' },
  { role: 'scram_user', label: 'scram-sha-256' },
]

/** What every driver's client offers (pg.Client, edgepg's Client and Neon's Client alike). */
interface DbClient {
  connect(): Promise<unknown>
  query(text: string, values?: unknown[]): Promise<{ rows: any[] }>
  end(): Promise<unknown>
  on(event: 'error', listener: (err: Error) => void): unknown
}

type ColdKey = 'edgepg' | 'neonA' | 'neonB' | 'neonC' | 'neonD' | 'pg'
const COLD_KEYS: readonly ColdKey[] = ['edgepg', 'neonA', 'neonB', 'neonC', 'neonD', 'pg']
const COLD_HEADERS: Record<ColdKey, string> = {
  edgepg: 'edgepg',
  neonA: 'Neon A',
  neonB: 'Neon B',
  neonC: 'Neon C',
  neonD: 'Neon D',
  pg: 'pg (TCP)',
}
const NEON_LEGEND = [
  'Neon A: default settings (pipelineConnect "password") via edgepg-proxy, which offloads auth.',
  'Neon B: pipelineConnect false via edgepg-proxy (the proxy asks for a cleartext password, then authenticates upstream).',
  'Neon C: pipelineConnect false via a plain relaying proxy (edgepg-proxy --no-auth-offload, like a bare wsproxy): ' +
    'the pg-compatible setting; Neon does md5/SCRAM itself, end to end with Postgres.',
  'Neon D: default settings (pipelineConnect "password") via the plain relaying proxy: works only where Postgres asks for a cleartext password.',
  'All Neon variants: @neondatabase/serverless Client, per-client neonConfig: webSocketConstructor ws, wsProxy "127.0.0.1:PORT/v1" ' +
    '(Neon appends ?address=<Postgres host:port>, an allowed upstream), useSecureWebSocket false, forceDisablePgSSL true, coalesceWrites true (defaults otherwise).',
]

/** One path to Postgres at 50 ms RTT: a turn counter in front of a delay relay. */
interface Path {
  port: number
  counter: TurnCounter
}

interface Cold {
  ms: number[]
  turns: number[]
  error?: string
}

const fmtRt = (msValue: number) => `${(msValue / RTT_MS).toFixed(1)} RT / ${msValue.toFixed(0)} ms`
const range = (xs: number[]) => (Math.min(...xs) === Math.max(...xs) ? `${xs[0]}` : `${Math.min(...xs)}-${Math.max(...xs)}`)

/** One cold connect + first query: elapsed ms and the round trips counted. Never leaves the client open. */
async function coldConnect(client: DbClient, path: Path): Promise<{ ms: number; turns: number }> {
  let lastError: Error | undefined
  client.on('error', (err) => (lastError = err))
  let timer: NodeJS.Timeout | undefined
  const timeout = new Promise<never>((_, reject) => {
    timer = setTimeout(() => reject(new Error(`no answer within ${ATTEMPT_TIMEOUT_MS} ms${lastError ? ` (${lastError.message})` : ''}`)), ATTEMPT_TIMEOUT_MS)
  })
  const t0 = performance.now()
  try {
    const work = (async () => {
      await client.connect()
      const { rows } = await client.query('SELECT 1 AS one')
      if (rows[0]?.one !== 1) throw new Error(`expected 1, got ${JSON.stringify(rows[0])}`)
    })()
    work.catch(() => {}) // if the timeout wins
    await Promise.race([work, timeout])
    return { ms: performance.now() - t0, turns: path.counter.latestTurns() }
  } finally {
    clearTimeout(timer)
    await Promise.race([client.end().catch(() => {}), new Promise((r) => setTimeout(r, 1000))])
  }
}

/** CPU ms this process spends on one cold connect + first query (the client's end() excluded). */
async function cpuOfConnect(client: DbClient): Promise<{ user: number; system: number }> {
  client.on('error', () => {})
  gc()
  await new Promise((r) => setTimeout(r, 10)) // let V8's background GC threads finish: they count too
  const before = process.cpuUsage()
  await client.connect()
  const { rows } = await client.query('SELECT 1 AS one')
  const used = process.cpuUsage(before)
  try {
    if (rows[0]?.one !== 1) throw new Error(`expected 1, got ${JSON.stringify(rows[0])}`)
  } finally {
    await client.end()
  }
  return { user: used.user / 1000, system: used.system / 1000 }
}

/** CONCURRENT queries issued at once on a connected client: elapsed ms and round trips counted. */
async function concurrentQueries(client: DbClient, path: Path, round: number): Promise<{ ms: number; turns: number }> {
  const turns0 = path.counter.latestTurns()
  const t0 = performance.now()
  const results = await Promise.all(Array.from({ length: CONCURRENT }, (_, i) => client.query('SELECT $1::int AS v', [round * 100 + i])))
  const ms = performance.now() - t0
  results.forEach((r, i) => {
    if (r.rows[0]?.v !== round * 100 + i) throw new Error(`connect: query ${i} answered ${JSON.stringify(r.rows[0])}`)
  })
  return { ms, turns: path.counter.latestTurns() - turns0 }
}

export const connect: Section = {
  name: 'connect',
  async run(ctx: BenchContext): Promise<Row[]> {
    const upstream = `${ctx.pg.host}:${ctx.pg.port}`
    const db = (role: Role) => ({ host: ctx.pg.host, port: ctx.pg.port, database: ctx.pg.database, user: role, password: PASSWORD })
    const edge = (role: Role, proxyPort: number) =>
      new Client({ ...db(role), webSocketConstructor: WebSocket as any, wsProxy: () => `ws://127.0.0.1:${proxyPort}/v2` })
    // Neon's per-client settings (client.neonConfig), so nothing global is changed.
    const neon = (role: Role, proxyPort: number, pipelineConnect: 'password' | false) => {
      const client = new NeonClient(db(role))
      const n = client.neonConfig
      n.webSocketConstructor = WebSocket as any
      n.wsProxy = `127.0.0.1:${proxyPort}/v1` // string form: Neon appends ?address=<Postgres host:port>
      n.useSecureWebSocket = false // ws:// on loopback (edgepg-proxy accepts passwords from loopback peers)
      n.forceDisablePgSSL = true // its default: no TLS inside the socket, as for edgepg here
      n.coalesceWrites = true // its default
      n.pipelineConnect = pipelineConnect
      return client as unknown as DbClient
    }
    const tcp = (role: Role, port: number, pipeline = false) => new pg.Client({ ...db(role), port, pipeline })

    const stoppers: (() => Promise<void>)[] = []
    try {
      // A plain relaying proxy, as a bare wsproxy would be: startup and auth pass through untouched.
      // Always a child process, so its relaying never counts as client CPU below.
      const plain: RunningProxy = await startProxy(upstream, 'child', { authOffload: false })
      stoppers.push(plain.stop)
      // The offloading proxy for the CPU measurement must not share this process either.
      const offload: RunningProxy = ctx.proxy.mode === 'child' ? { ...ctx.proxy, stop: async () => {} } : await startProxy(upstream, 'child')
      stoppers.push(offload.stop)

      const path = async (target: { host: string; port: number }): Promise<Path> => {
        const delay = await startDelayRelay(target, ONE_WAY_MS)
        stoppers.push(delay.close)
        const counter = await startTurnCounter({ host: '127.0.0.1', port: delay.port })
        stoppers.push(counter.close)
        return { port: counter.port, counter }
      }
      const toOffload = () => path({ host: '127.0.0.1', port: ctx.proxy.port })
      const toPlain = () => path({ host: '127.0.0.1', port: plain.port })
      const toPg = () => path({ host: ctx.pg.host, port: ctx.pg.port })

      // 1. New connection + first query, per auth method, at 50 ms RTT.
      const paths: Record<ColdKey, Path> = {
        edgepg: await toOffload(),
        neonA: await toOffload(),
        neonB: await toOffload(),
        neonC: await toPlain(),
        neonD: await toPlain(),
        pg: await toPg(),
      }
      const makeCold: Record<ColdKey, (role: Role) => DbClient> = {
        edgepg: (role) => edge(role, paths.edgepg.port),
        neonA: (role) => neon(role, paths.neonA.port, 'password'),
        neonB: (role) => neon(role, paths.neonB.port, false),
        neonC: (role) => neon(role, paths.neonC.port, false),
        neonD: (role) => neon(role, paths.neonD.port, 'password'),
        pg: (role) => tcp(role, paths.pg.port),
      }
      for (const key of COLD_KEYS) await coldConnect(makeCold[key]('password_user'), paths[key]).catch(() => {}) // warm-up
      const cold = {} as Record<Role, Record<ColdKey, Cold>>
      for (const { role } of AUTH) {
        const byKey = (cold[role] = {} as Record<ColdKey, Cold>)
        for (const key of COLD_KEYS) byKey[key] = { ms: [], turns: [] }
        await interleave(COLD_KEYS, COLD_RUNS, async (key) => {
          const m = byKey[key]
          if (m.error) return // it failed once; it fails the same way again
          try {
            const { ms, turns } = await coldConnect(makeCold[key](role), paths[key])
            m.ms.push(ms)
            m.turns.push(turns)
          } catch (err) {
            m.error = (err as Error).message
          }
        })
      }
      // Every driver but Neon D (which cannot work with md5/SCRAM by design) must have worked.
      for (const { role } of AUTH) {
        for (const key of COLD_KEYS) {
          const { error } = cold[role][key]
          if (error && key !== 'neonD') throw new Error(`connect: ${COLD_HEADERS[key]} failed for ${role}: ${error}`)
        }
      }

      // 2. CONCURRENT queries at once on a warm connection, at 50 ms RTT; a path per client, so
      // each counter sees one connection.
      type WarmKey = 'edgepg' | 'neon' | 'pg' | 'pgPipeline'
      const WARM_KEYS: readonly WarmKey[] = ['edgepg', 'neon', 'pg', 'pgPipeline']
      const warmPaths: Record<WarmKey, Path> = { edgepg: await toOffload(), neon: await toPlain(), pg: await toPg(), pgPipeline: await toPg() }
      const warmClients: Record<WarmKey, DbClient> = {
        edgepg: edge('scram_user', warmPaths.edgepg.port),
        neon: neon('scram_user', warmPaths.neon.port, false),
        pg: tcp('scram_user', warmPaths.pg.port),
        pgPipeline: tcp('scram_user', warmPaths.pgPipeline.port, true),
      }
      const warm: Record<WarmKey, { ms: number[]; turns: number[] }> = {
        edgepg: { ms: [], turns: [] },
        neon: { ms: [], turns: [] },
        pg: { ms: [], turns: [] },
        pgPipeline: { ms: [], turns: [] },
      }
      let warmFailure: Error | undefined
      for (const [name, c] of Object.entries(warmClients)) c.on('error', (err) => (warmFailure ??= new Error(`connect: ${name} client failed: ${err.message}`)))
      try {
        await Promise.all(Object.values(warmClients).map((c) => c.connect()))
        for (const c of Object.values(warmClients)) await c.query('SELECT 1') // warm
        await interleave(WARM_KEYS, WARM_ROUNDS, async (key, round) => {
          if (warmFailure) throw warmFailure
          const { ms, turns } = await concurrentQueries(warmClients[key], warmPaths[key], round)
          warm[key].ms.push(ms)
          warm[key].turns.push(turns)
        })
        if (warmFailure) throw warmFailure
      } finally {
        await Promise.all(Object.values(warmClients).map((c) => c.end().catch(() => {})))
      }

      // 3. Client CPU per cold connect + first query, scram_user, on loopback (no relays). Neon C
      // spends a few hundred ms of CPU per connect on SCRAM and would load the others'
      // measurements with its garbage if interleaved with them: it runs in a block of its own.
      type CpuKey = 'edgepg' | 'neonA' | 'pg' | 'neonC'
      const CPU_KEYS: readonly CpuKey[] = ['edgepg', 'neonA', 'pg']
      const makeCpu: Record<CpuKey, () => DbClient> = {
        edgepg: () => edge('scram_user', offload.port),
        neonA: () => neon('scram_user', offload.port, 'password'),
        pg: () => tcp('scram_user', ctx.pg.port),
        neonC: () => neon('scram_user', plain.port, false),
      }
      const cpu: Record<CpuKey, { user: number; system: number }[]> = { edgepg: [], neonA: [], pg: [], neonC: [] }
      for (const key of CPU_KEYS) for (let i = 0; i < CPU_WARMUP; i++) await cpuOfConnect(makeCpu[key]())
      await interleave(CPU_KEYS, CPU_RUNS, async (key) => {
        cpu[key].push(await cpuOfConnect(makeCpu[key]()))
      })
      for (let i = 0; i < CPU_WARMUP; i++) await cpuOfConnect(makeCpu.neonC())
      for (let i = 0; i < CPU_RUNS; i++) cpu.neonC.push(await cpuOfConnect(makeCpu.neonC()))

      // Tables.
      const rows: Row[] = []
      const failed = (error: string) => `fails: ${error.length > 60 ? error.slice(0, 57) + '...' : error}`
      const coldMs = (c: Cold) => median(c.ms)
      const coldTurns = (c: Cold) => Math.max(...c.turns)
      const verdict = AUTH.map(({ role }) => coldTurns(cold[role].edgepg) <= RT_TARGET)
      const coldHeader = ['auth method', ...COLD_KEYS.map((k) => COLD_HEADERS[k]), 'target', 'result']
      const coldTable = (cell: (c: Cold) => string) =>
        AUTH.map(({ role, label }, i) => [
          label,
          ...COLD_KEYS.map((k) => (cold[role][k].error ? failed(cold[role][k].error!) : cell(cold[role][k]))),
          `edgepg <= ${RT_TARGET} RT`,
          verdict[i] ? 'pass' : 'MISS',
        ])
      printGrid(`connect: new connection + first query at ${RTT_MS} ms RTT (median of ${COLD_RUNS}; elapsed / RTT, and ms)`, coldHeader, coldTable((c) => fmtRt(coldMs(c))), [
        ...NEON_LEGEND,
        `Method: a delay relay (test/support/delay-relay.ts, in this process) holding every chunk ${ONE_WAY_MS} ms each way sits in front of ` +
          `edgepg-proxy (${ctx.proxy.mode === 'child' ? 'child process' : 'in this process'}) for edgepg and Neon A/B, in front of the ` +
          `plain proxy (child process) for Neon C/D, and in front of Postgres itself for pg over TCP. Each run: new Client, ` +
          `connect(), query('SELECT 1'), timed; end() untimed. ${COLD_RUNS} runs per driver and auth method, drivers in alternating ` +
          `order, after one warm-up each. The result column judges edgepg's round trips as counted (next table).`,
        `Neon D's failures are by design: with pipelineConnect "password" Neon sends a cleartext password unasked, which ` +
          `Postgres refuses when it asks for md5 or SCRAM. Behind a plain WebSocket proxy Neon has to run with pipelineConnect ` +
          `false (Neon C) and do md5/SCRAM itself; its default pipelining works through edgepg-proxy (Neon A) only because ` +
          `edgepg-proxy offloads auth.`,
      ])
      printGrid(
        `connect: round trips counted for new connection + first query (and the rest of the elapsed time: local work)`,
        coldHeader,
        coldTable((c) => `${range(c.turns)} RT + ${Math.max(0, coldMs(c) - coldTurns(c) * RTT_MS).toFixed(0)} ms`),
        [
          `Counted by a pass-through relay in front of each delay relay (bench/turn-counter.ts): a round trip is each time ` +
            `the client speaks after the server has (its first bytes included), up to the first query's result. ` +
            `"+ N ms" = median elapsed - round trips x ${RTT_MS} ms: backend start, auth at the proxy or the client, relay timers.`,
          `Not simulated: the relays are on loopback, so TCP's handshake (and TLS for wss://) is not delayed. On a real network ` +
            `every driver pays one more round trip for TCP, and the WebSocket drivers a TLS handshake too (pg over TCP with ` +
            `sslmode=require an SSLRequest round trip plus its TLS handshake).`,
          `Neon C with scram-sha-256: its extra ${Math.max(0, coldMs(cold.scram_user.neonC) - coldTurns(cold.scram_user.neonC) * RTT_MS).toFixed(0)} ms ` +
            `is mostly Neon's own SCRAM: it derives the key with one awaited WebCrypto HMAC call per PBKDF2 iteration ` +
            `(Postgres's default: 4096), see the CPU table below.`,
        ]
      )
      AUTH.forEach(({ role, label }, i) =>
        rows.push({
          metric: `connect + first query, ${label}: round trips`,
          edgepg: `${range(cold[role].edgepg.turns)} RT (${coldMs(cold[role].edgepg).toFixed(0)} ms at ${RTT_MS} ms RTT)`,
          baseline: cold[role].neonC.error ? failed(cold[role].neonC.error) : `${range(cold[role].neonC.turns)} RT (Neon C)`,
          ratio: coldTurns(cold[role].edgepg),
          target: RT_TARGET,
        })
      )

      const warmMs = (k: WarmKey) => median(warm[k].ms)
      const warmTurns = (k: WarmKey) => Math.max(...warm[k].turns)
      const warmCell = (k: WarmKey) => `${range(warm[k].turns)} RT counted; ${fmtRt(warmMs(k))}`
      const warmOk = warmTurns('edgepg') <= WARM_TARGET
      rows.push({
        metric: `${CONCURRENT} concurrent queries on a warm connection: round trips`,
        edgepg: warmCell('edgepg'),
        baseline: warmCell('pg'),
        ratio: warmTurns('edgepg'),
        target: WARM_TARGET,
      })
      printGrid(
        `connect: ${CONCURRENT} concurrent queries on a warm connection at ${RTT_MS} ms RTT (median of ${WARM_ROUNDS})`,
        ['metric', 'edgepg', 'Neon', 'pg (TCP)', 'target', 'result'],
        [[`${CONCURRENT} x SELECT $1::int, Promise.all`, warmCell('edgepg'), warmCell('neon'), warmCell('pg'), `edgepg <= ${WARM_TARGET} RT`, warmOk ? 'pass' : 'MISS']],
        [
          `Paths as above (a turn counter and delay relay of its own per client), role scram_user, one connection per driver ` +
            `opened and warmed beforehand; Neon as Neon C (pipelineConnect only changes startup). ${WARM_ROUNDS} rounds per ` +
            `driver in alternating order. pg itself warns (DeprecationWarning, once) about query() while a query is running.`,
          `Reference, no target: pg over TCP with its own pipeline: true option: ${warmCell('pgPipeline')}.`,
        ]
      )

      const mean = (xs: number[]) => xs.reduce((a, b) => a + b, 0) / xs.length
      const cpuTotals = (key: CpuKey) => cpu[key].map((u) => u.user + u.system)
      const cpuMs = (key: CpuKey) => mean(cpuTotals(key))
      const cpuCell = (key: CpuKey) =>
        `${cpuMs(key).toFixed(2)} ms (${mean(cpu[key].map((u) => u.user)).toFixed(2)} user + ${mean(cpu[key].map((u) => u.system)).toFixed(2)} sys)`
      const cpuOk = cpuMs('edgepg') <= CPU_TARGET_MS
      rows.push({
        metric: 'client CPU per cold connect + first query (SCRAM upstream)',
        edgepg: `${cpuMs('edgepg').toFixed(2)} ms`,
        baseline: `${cpuMs('pg').toFixed(2)} ms`,
        ratio: cpuMs('edgepg'),
        target: CPU_TARGET_MS,
      })
      printGrid(
        `connect: client CPU per cold connect + first query, scram_user, loopback (mean of ${CPU_RUNS})`,
        ['metric', 'edgepg', 'Neon A', 'Neon C', 'pg (TCP)', 'target', 'result'],
        [['process.cpuUsage() per connect', cpuCell('edgepg'), cpuCell('neonA'), cpuCell('neonC'), cpuCell('pg'), `edgepg <= ${CPU_TARGET_MS} ms`, cpuOk ? 'pass' : 'MISS']],
        [
          `Who computes SCRAM-SHA-256 (Postgres's default 4096 PBKDF2 iterations): for edgepg and Neon A, edgepg-proxy does ` +
            `(a child process, not counted; the client sends a cleartext password); Neon C (through the plain proxy, a child ` +
            `process) and pg over TCP compute it in this process.`,
          `Method: no delay relay; user + system CPU of this whole process (all threads, so WebCrypto's thread pool too) ` +
            `from just before connect() to the first query's result, end() excluded, a full GC and 10 ms of quiet before ` +
            `each; ${CPU_WARMUP} warm-up connects per driver, then ${CPU_RUNS} per driver, edgepg / Neon A / pg in alternating ` +
            `order, Neon C in a block of its own afterwards (its garbage would otherwise land in the others' measurements). ` +
            `Medians: ${(['edgepg', 'neonA', 'neonC', 'pg'] as const).map((k) => `${k} ${median(cpuTotals(k)).toFixed(2)} ms`).join(', ')}.`,
        ]
      )
      return rows
    } finally {
      for (const stop of stoppers.reverse()) await stop().catch(() => {})
    }
  },
}
