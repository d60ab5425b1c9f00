/**
 * Section "attack": what a client with no credentials can make edgepg-proxy hold, and what a
 * legitimate client on 127.0.0.1 sees meanwhile. Each attack runs against a fresh proxy child
 * (test/support/child-proxy.ts: `tsx proxy/cli.ts`, its RSS read from /proc) from 127.0.0.2–.6 (all of
 * 127/8 is loopback on Linux), holds until the legitimate tries under it are done, then its
 * sockets are destroyed:
 * - memory: upgrades each sending one WebSocket frame that stops a byte short of complete, before
 *   login and after it (the password in the upgrade), the latter also with glibc told to hand
 *   freed socket buffers back (MALLOC_MMAP_THRESHOLD_, as docs/deployment.md advises);
 * - logins: upgrades whose login is a StartupMessage for a real role with no password, so that
 *   Postgres asks the client to authenticate, and it never does;
 * - /sql: POSTs whose bodies never finish.
 */
import { readFileSync } from 'node:fs'
import http from 'node:http'
import net from 'node:net'
import { setTimeout as sleep } from 'node:timers/promises'
import pg from 'pg'
import { WebSocket } from 'ws'
import { Client } from '../src/index'
import { startGcProxy, type GcProxy } from '../test/support/child-proxy'
import { passwordMessage, startupMessage } from '../test/support/protocol'
import { LOGIN_PREFIX, SUBPROTOCOL } from '../src/config'
import { PASSWORD } from '../test/support/stack'
import { percentile, printGrid, type BenchContext, type Section } from './lib'

/**
 * edgepg-proxy's flags for every attack: its defaults, but room for the login attack's 450
 * sessions, so that they are not refused at the door and what the proxy bounds behind it shows.
 * Limits under test (--max-logins, --max-logins-per-ip, --max-client-buffer, …) go here.
 */
export const ATTACK_PROXY_FLAGS = ['--max-sessions', '2000', '--max-sessions-per-ip', '500', '--shutdown-grace', '0']

const ATTACKERS = ['127.0.0.2', '127.0.0.3', '127.0.0.4', '127.0.0.5', '127.0.0.6']
const FRAMES = 20
const MiB = 1 << 20
const FRAME_BYTES = 60 * MiB
const LOGINS_PER_ADDRESS = 90
const SQL_POSTS = 500

const TRIES = 20
const WARMUP = 3
/** A legitimate try not answered within this long fails as "timeout" (and bounds the section's time). */
const TRY_TIMEOUT_MS = 2000
/** How long after the attackers' sockets are destroyed the proxy's RSS is read again. */
const SETTLE_MS = 2000
const SAMPLE_MS = 100
/** Pool keys of the legitimate logins: left out of the Postgres counts. */
const LEGIT_APP = 'bench-attack-'

/** An attack in place: its connections, how many the proxy still holds open, and an end to them. */
interface Running {
  total: number
  holding(): number
  stop(): void
}

interface Attack {
  name: string
  /** What the legitimate client does meanwhile. */
  legit: 'login' | 'sql'
  /** Opens the attack; resolves once it is in place. */
  start(proxy: ChildProxy, ctx: BenchContext): Promise<Running>
  /** The proxy child's environment, beside this process's. */
  env?: Record<string, string>
}

type ChildProxy = GcProxy
const MMAP = { MALLOC_MMAP_THRESHOLD_: '65536' }

const ATTACKS: Attack[] = [
  { name: `memory: ${FRAMES} frames of ${FRAME_BYTES / MiB} MiB, 1 byte short, before login`, legit: 'login', start: (p) => unfinishedFrames(p) },
  { name: `the same, logged in`, legit: 'login', start: (p, ctx) => unfinishedFrames(p, ctx) },
  { name: `the same, logged in, ${Object.entries(MMAP).map(([k, v]) => `${k}=${v}`)}`, legit: 'login', start: (p, ctx) => unfinishedFrames(p, ctx), env: MMAP },
  { name: `logins: ${ATTACKERS.length} × ${LOGINS_PER_ADDRESS} startups, no password`, legit: 'login', start: unansweredLogins },
  { name: `/sql: ${SQL_POSTS} bodies never finished`, legit: 'sql', start: unfinishedBodies },
]

export const attack: Section = {
  name: 'attack',
  async run(ctx) {
    const cells: string[][] = []
    for (const a of ATTACKS) cells.push(await measure(ctx, a))
    const nofile = /^Max open files\s+(\d+)/m.exec(readFileSync('/proc/self/limits', 'utf8'))?.[1] ?? '?'
    printGrid(
      'attack: what a client with no credentials makes edgepg-proxy hold, and what a legitimate client sees',
      ['attack', 'held', 'proxy RSS before / peak / after / after GC', 'Postgres backends', 'Postgres sockets', 'legit p50 / p99, no attack', 'under attack', 'failed'],
      cells,
      [
        `A fresh proxy child per attack (tsx proxy/cli.ts: RSS includes tsx's loader), flags: ${ATTACK_PROXY_FLAGS.join(' ')}. ` +
          `Attackers from ${ATTACKERS[0]}–.${ATTACKERS.at(-1)!.split('.')[3]} (the /sql attack from ${ATTACKERS[0]} only); each attack ends when the legitimate tries under it are done.`,
        `held: attacker connections the proxy still held when the attack was in place → when the tries under it were done, of all it opened. ` +
          `RSS: peak sampled every ${SAMPLE_MS} ms during the attack; after, ${SETTLE_MS / 1000} s after the attackers' sockets are destroyed; then once more after full GCs in the proxy (until Buffers are freed). ` +
          `The budget for unfinished messages (--max-client-buffer) is its default, 256 MiB.`,
        `Postgres, before / peak / after (sampled every ${SAMPLE_MS} ms), the legitimate client's own left out (but for one still logging in): backends = client backends in pg_stat_activity; ` +
          `sockets = established TCP connections to Postgres's port (/proc/net/tcp), which also counts connections whose backend waits for a startup packet or is being refused.`,
        `legit: ${TRIES} tries one after another from 127.0.0.1, p50 / p99 of those that succeeded (a try not answered in ${TRY_TIMEOUT_MS / 1000} s fails as "timeout"). ` +
          `WebSocket attacks: a fresh edgepg Client login (scram_user; a distinct application_name per try, so no warm backend serves it; the pool stays on) + SELECT 1, timed to its result. ` +
          `/sql: one POST /sql SELECT 1 on a kept-alive node:http connection.`,
        `Open files allowed (ulimit -n): ${nofile}; the login attack needs ~${ATTACKERS.length * LOGINS_PER_ADDRESS} in this process and ~${2 * ATTACKERS.length * LOGINS_PER_ADDRESS} in the proxy (a client and a Postgres socket each).`,
      ]
    )
    return []
  },
}

async function measure(ctx: BenchContext, a: Attack): Promise<string[]> {
  const proxy = await startGcProxy(`${ctx.pg.host}:${ctx.pg.port}`, ATTACK_PROXY_FLAGS, a.env)
  const admin = new pg.Client({ host: ctx.pg.host, port: ctx.pg.port, database: ctx.pg.database, user: 'postgres', password: PASSWORD })
  // Connected before the attack: once Postgres is full, not even a superuser gets in.
  await admin.connect()
  const legit = a.legit === 'sql' ? sqlClient(ctx, proxy) : loginClient(ctx, proxy)
  let running: Running | undefined
  let rssTimer: NodeJS.Timeout | undefined
  let sampling = true
  try {
    await tries(legit.once, WARMUP)
    const without = await tries(legit.once, TRIES)
    const before = proxy.rss()
    const rss = { before, peak: before, after: 0 }
    const holds = (): Promise<number[]> => postgresHolds(admin, ctx.pg.port)
    const pgBefore = await holds()
    const pgPeak = [...pgBefore]
    rssTimer = setInterval(() => (rss.peak = Math.max(rss.peak, proxy.rss())), SAMPLE_MS)
    const pgSampler = (async () => {
      for (; sampling; await sleep(SAMPLE_MS)) (await holds()).forEach((n, i) => (pgPeak[i] = Math.max(pgPeak[i], n)))
    })()
    running = await a.start(proxy, ctx)
    const inPlace = running.holding()
    const under = await tries(legit.once, TRIES)
    const held = `${inPlace} → ${running.holding()} of ${running.total}`
    running.stop()
    sampling = false
    await pgSampler
    clearInterval(rssTimer)
    await sleep(SETTLE_MS)
    rss.after = proxy.rss()
    // V8 frees what Buffers held as it sweeps, after the GC: a few rounds, until it has.
    let afterGc = await proxy.memoryAfterGc()
    for (let round = 0; round < 5 && afterGc.arrayBuffers > 8 * MiB; round++) await sleep(250), (afterGc = await proxy.memoryAfterGc())
    const pgAfter = await holds()
    const mib = (b: number) => `${Math.round(b / MiB)}`
    const pgCells = pgBefore.map((_, i) => `${pgBefore[i]} / ${pgPeak[i]} / ${pgAfter[i]}`)
    return [a.name, held, `${[rss.before, rss.peak, rss.after, afterGc.rss].map(mib).join(' / ')} MiB`, ...pgCells, latency(without), latency(under), failed(under)]
  } finally {
    sampling = false
    clearInterval(rssTimer)
    running?.stop()
    legit.close()
    await admin.end().catch(() => {})
    await proxy.stop()
  }
}

/** Client backends in pg_stat_activity, and established TCP connections to Postgres; neither counting `admin` nor the legitimate logins. */
async function postgresHolds(admin: pg.Client, port: number): Promise<number[]> {
  const { rows } = await admin.query(
    `SELECT count(*) FILTER (WHERE pid <> pg_backend_pid() AND application_name NOT LIKE $1)::int AS backends,
            array_agg(client_port) FILTER (WHERE pid = pg_backend_pid() OR application_name LIKE $1) AS ours
     FROM pg_stat_activity WHERE backend_type = 'client backend'`,
    [`${LEGIT_APP}%`]
  )
  const ours = new Set<number>(rows[0].ours)
  // Postgres's side of each connection: local port = Postgres's, state 01 = ESTABLISHED.
  let sockets = 0
  for (const line of readFileSync('/proc/net/tcp', 'utf8').split('\n').slice(1)) {
    const [, local, remote, state] = line.trim().split(/\s+/)
    if (state === '01' && parseInt(local.split(':')[1], 16) === port && !ours.has(parseInt(remote.split(':')[1], 16))) sockets++
  }
  return [rows[0].backends, sockets]
}

interface Tries {
  times: number[]
  failures: string[]
}

/** `n` tries one after another, each resolving with its own latency in ms. */
async function tries(once: () => Promise<number>, n: number): Promise<Tries> {
  const result: Tries = { times: [], failures: [] }
  for (let i = 0; i < n; i++) {
    try {
      result.times.push(await bounded(once(), TRY_TIMEOUT_MS))
    } catch (err) {
      result.failures.push((err as { code?: string }).code ?? (err as Error).message)
    }
  }
  return result
}

const latency = ({ times }: Tries) => (times.length ? `${percentile(times, 50).toFixed(2)} / ${percentile(times, 99).toFixed(2)} ms` : '–')

function failed({ failures }: Tries): string {
  if (!failures.length) return '0'
  const counts = new Map<string, number>()
  for (const f of failures) counts.set(f, (counts.get(f) ?? 0) + 1)
  return `${failures.length} (${[...counts].map(([f, n]) => `${n}× ${f.slice(0, 40)}`).join(', ')})`
}

function bounded<T>(promise: Promise<T>, ms: number): Promise<T> {
  let timer: NodeJS.Timeout | undefined
  const timeout = new Promise<never>((_, reject) => (timer = setTimeout(() => reject(new Error('timeout')), ms)))
  return Promise.race([promise, timeout]).finally(() => clearTimeout(timer))
}

interface LegitClient {
  once(): Promise<number>
  close(): void
}

/** A fresh login each time: a new application_name is a new pool key, so no warm backend serves it. */
function loginClient(ctx: BenchContext, proxy: ChildProxy): LegitClient {
  let n = 0
  return {
    async once() {
      const client = new Client({ ...ctx.edgeConfig(), wsProxy: () => proxy.url, application_name: `${LEGIT_APP}${n++}` })
      client.on('error', () => {})
      try {
        const start = performance.now()
        await client.connect()
        await client.query('SELECT 1')
        return performance.now() - start
      } finally {
        void bounded(client.end(), TRY_TIMEOUT_MS).catch(() => {})
      }
    },
    close() {},
  }
}

/** POST /sql on one kept-alive connection (global fetch costs ~1 ms more per request here). */
function sqlClient(ctx: BenchContext, proxy: ChildProxy): LegitClient {
  const agent = new http.Agent({ keepAlive: true, maxSockets: 1 })
  const headers = { 'Neon-Connection-String': connectionString(ctx), 'Content-Type': 'application/json' }
  const body = JSON.stringify({ query: 'SELECT 1' })
  return {
    once: () =>
      new Promise((resolve, reject) => {
        const start = performance.now()
        const req = http.request({ host: '127.0.0.1', port: proxy.port, path: '/sql', method: 'POST', agent, headers }, (res) => {
          res.resume()
          res.on('end', () => (res.statusCode === 200 ? resolve(performance.now() - start) : reject(new Error(`HTTP ${res.statusCode}`))))
        })
        req.on('error', reject)
        req.end(body)
      }),
    close: () => agent.destroy(),
  }
}

function connectionString(ctx: BenchContext) {
  const { user, password, host, port, database } = ctx.pgConfig() as Record<string, string>
  return `postgresql://${user}:${encodeURIComponent(password)}@${host}:${port}/${database}`
}

const attacker = (i: number) => ATTACKERS[i % ATTACKERS.length]

/** An attack's connections: each counts as held until its release is called. */
function holdings<S>(destroy: (s: S) => void) {
  const all: S[] = []
  const open = new Set<S>()
  return {
    add(s: S) {
      all.push(s)
      open.add(s)
      return () => void open.delete(s)
    },
    running: (): Running => ({ total: all.length, holding: () => open.size, stop: () => all.forEach(destroy) }),
  }
}

/** A WebSocket upgrade to /v2 by hand; resolves with the socket once the proxy has answered (101 or not). */
function rawUpgrade(port: number, localAddress: string, protocols?: string[]): Promise<{ socket: net.Socket; status: string }> {
  return new Promise((resolve, reject) => {
    const socket = net.connect({ host: '127.0.0.1', port, localAddress })
    let head = ''
    socket.on('error', () => {})
    socket.once('close', () => reject(new Error(`upgrade from ${localAddress}: closed before an answer`)))
    socket.on('connect', () =>
      socket.write(
        'GET /v2 HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n' +
          (protocols ? `Sec-WebSocket-Protocol: ${protocols.join(', ')}\r\n` : '') +
          '\r\n'
      )
    )
    const onData = (d: Buffer) => {
      head += d.toString('latin1')
      if (!head.includes('\r\n\r\n')) return
      socket.off('data', onData)
      socket.on('data', () => {}) // whatever comes later (a close frame) is read and never answered
      resolve({ socket, status: head.split('\r\n')[0] })
    }
    socket.on('data', onData)
  })
}

/** The login in the upgrade (proxy/login/in-upgrade.ts): a startup, and its password unless `password` is undefined. */
function loginProtocols(ctx: BenchContext, password: string | undefined): string[] {
  const login = [startupMessage({ user: 'scram_user', database: ctx.pg.database }), ...(password === undefined ? [] : [passwordMessage(password)])]
  return [SUBPROTOCOL, LOGIN_PREFIX + Buffer.concat(login).toString('base64url')]
}

/**
 * Attack 1: each upgrade (logged in by the login in it, with `ctx`; else none) sends one masked
 * binary frame declaring FRAME_BYTES, all but its last byte, and holds.
 */
async function unfinishedFrames(proxy: ChildProxy, ctx?: BenchContext): Promise<Running> {
  const held = holdings<net.Socket>((s) => s.destroy())
  const chunk = Buffer.alloc(MiB)
  const header = Buffer.alloc(14) // the 4-byte mask key at the end stays zero
  header[0] = 0x82 // FIN, binary
  header[1] = 0x80 | 127 // masked; a 64-bit length follows
  header.writeBigUInt64BE(BigInt(FRAME_BYTES), 2)
  const send = async (i: number) => {
    const { socket, status } = await rawUpgrade(proxy.port, attacker(i), ctx && loginProtocols(ctx, PASSWORD))
    const release = held.add(socket)
    const closed = new Promise<void>((resolve) => socket.once('close', () => (release(), resolve())))
    if (!status.includes(' 101 ')) return void socket.destroy()
    socket.write(header)
    for (let left = FRAME_BYTES - 1; left > 0 && !socket.destroyed; left -= chunk.length) {
      if (!socket.write(left >= chunk.length ? chunk : chunk.subarray(0, left))) await Promise.race([new Promise((r) => socket.once('drain', r)), closed])
    }
  }
  try {
    await Promise.all(Array.from({ length: FRAMES }, (_, i) => send(i)))
  } catch (err) {
    held.running().stop()
    throw err
  }
  await sleep(300) // the last writes leave the kernel's buffers for the proxy
  return held.running()
}

/**
 * Attack 2: each upgrade's login is a StartupMessage for a real role and no password: the proxy
 * takes it to Postgres, which asks for SCRAM, and the client never answers. Resolves once every
 * upgrade is answered or waiting its turn (a login past --max-logins waits, unanswered).
 */
async function unansweredLogins(proxy: ChildProxy, ctx: BenchContext): Promise<Running> {
  const held = holdings<WebSocket>((ws) => ws.terminate())
  const protocols = loginProtocols(ctx, undefined)
  const login = (i: number) => {
    const ws = new WebSocket(proxy.url, protocols, { localAddress: attacker(i) })
    const release = held.add(ws)
    ws.on('error', () => {})
    ws.once('close', release)
  }
  for (let i = 0; i < ATTACKERS.length * LOGINS_PER_ADDRESS; i++) login(i)
  await sleep(1000)
  return held.running()
}

/** Attack 3: POSTs from one address whose bodies stop at 20 of their 100 bytes. */
async function unfinishedBodies(proxy: ChildProxy, ctx: BenchContext): Promise<Running> {
  const held = holdings<net.Socket>((s) => s.destroy())
  const request = `POST /sql HTTP/1.1\r\nHost: x\r\nNeon-Connection-String: ${connectionString(ctx)}\r\nContent-Length: 100\r\n\r\n{"query": "SELECT 1"`
  const post = () =>
    new Promise<void>((resolve) => {
      const socket = net.connect({ host: '127.0.0.1', port: proxy.port, localAddress: ATTACKERS[0] })
      const release = held.add(socket)
      // Answered (429 now, 408 at the read timeout) is no longer held, even if the socket stays open.
      socket.once('data', release)
      socket.once('close', () => (release(), resolve()))
      socket.on('error', () => {})
      socket.on('connect', () => socket.write(request, () => resolve()))
    })
  await Promise.all(Array.from({ length: SQL_POSTS }, post))
  await sleep(300) // the proxy has read every request's head
  return held.running()
}
