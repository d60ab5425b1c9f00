/**
 * Hostile input to edgepg-proxy's startup phase: ≥ 10,000 random and mutated inputs from a seeded
 * PRNG (bad and huge lengths, truncated packets, unknown protocol codes, text frames, garbage
 * after SSLRequest, startup parameters without a terminator, one-byte and empty frames, closing
 * mid-packet, …) through one in-process proxy in front of the test Postgres, 50 sessions at a
 * time; then floods of half-open connections. Throughout: the proxy never crashes (no uncaught
 * exception or unhandled rejection), its sessions, upstream sockets and heap stay bounded and
 * drain, and every session ends with an ErrorResponse and/or a close within a bound.
 *
 * Reproduce a run with EDGEPG_FUZZ_SEED=<seed> (printed at the start); EDGEPG_FUZZ_COUNT
 * overrides the number of sessions (default 10,000).
 *
 * Stalled inputs: an input that is a valid prefix (a truncated packet, a startup still waiting
 * for its password, a relayed session) leaves the proxy correctly waiting for more. Such a session
 * gets, after SETTLE_MS without an answer, a tail of 70,000 0xFF bytes — enough to complete any
 * packet or message the startup phase may be waiting for and to make it invalid — and must then
 * end. Those sessions are counted as "stalled → tail" in the summary.
 */
import { test, describe, before, after } from 'node:test'
import assert from 'node:assert/strict'
import net from 'node:net'
import v8 from 'node:v8'
import vm from 'node:vm'
import { setTimeout as sleep } from 'node:timers/promises'
import { WebSocket } from 'ws'
import pg from 'pg'
import { createProxy, type ProxyOptions, type SessionLog } from '../proxy/index'
import { ByteQueue } from '../proxy/wire/bytes'
import { Client } from '../src/index'
import { SUBPROTOCOL } from '../src/config'
import { PASSWORD } from './support/stack'
import { pgConfig, testPostgres, backends, eventually, within } from './support/helpers'
import { CANCEL_CODE, PROTOCOL_3, TERMINATE, cstrings, gssencRequest, int32, message, packet, passwordMessage, sslRequest, startupMessage } from './support/protocol'
import { prng } from './support/prng'

const PG = testPostgres()
const UPSTREAM = `${PG.host}:${PG.port}`
const SEED = process.env.EDGEPG_FUZZ_SEED ? Number(process.env.EDGEPG_FUZZ_SEED) >>> 0 : (Date.now() ^ (process.pid << 16)) >>> 0
const COUNT = Number(process.env.EDGEPG_FUZZ_COUNT ?? 10_000)
const CONCURRENCY = 50
/** How long a session may stay silent before it is taken as stalled (waiting for more input). */
const SETTLE_MS = 150
/** How long a session has to end once it was answered or given the tail. */
const END_MS = 2000
const MB = 1 << 20

console.log(`# edgepg fuzz: seed ${SEED} (EDGEPG_FUZZ_SEED=${SEED} to reproduce), ${COUNT} sessions`)

// ---------------------------------------------------------------------------------------------
// Nothing may escape the proxy.

const escaped: string[] = []
process.on('uncaughtException', (err) => escaped.push(`uncaughtException: ${err?.stack ?? err}`))
process.on('unhandledRejection', (reason) => escaped.push(`unhandledRejection: ${(reason as Error)?.stack ?? reason}`))
const nothingEscaped = (what: string) => assert.deepEqual(escaped, [], `nothing escaped the proxy (${what})`)

// ---------------------------------------------------------------------------------------------
// Heap, with a real GC (test/support/run.ts starts node without --expose-gc).

v8.setFlagsFromString('--expose-gc')
const gc = vm.runInNewContext('gc') as () => void
async function heapMB() {
  for (let i = 0; i < 3; i++) {
    gc()
    await sleep(20)
  }
  return process.memoryUsage().heapUsed / MB
}
const fmt = (mb: number) => `${mb.toFixed(1)} MB`

// ---------------------------------------------------------------------------------------------
// Upstream sockets: every socket the proxy dials to Postgres is counted (not kept) while open.
// The proxy connects with an options object ({ host, port }, or net.connect's normalized
// [options, callback]); the test's own clients use ws (to the proxy) or pg, which passes (port, host).

const upstreams = { opened: 0, open: 0, maxOpen: 0, ports: new Set<number>() }
{
  const original = net.Socket.prototype.connect
  net.Socket.prototype.connect = function (this: net.Socket, ...args: any[]) {
    const options = Array.isArray(args[0]) ? args[0][0] : args[0]
    if (typeof options === 'object' && options !== null && Number(options.port) === PG.port) {
      upstreams.opened++
      upstreams.maxOpen = Math.max(upstreams.maxOpen, ++upstreams.open)
      this.once('connect', () => upstreams.ports.add(this.localPort!))
      this.once('close', () => upstreams.open--)
    }
    return original.apply(this, args as any)
  } as typeof original
  after(() => void (net.Socket.prototype.connect = original))
}

// ---------------------------------------------------------------------------------------------
// A proxy that counts its sessions: accepted upgrades vs. session log lines (one per ended session).

function outcomeKey(outcome: string) {
  return outcome.replace(/message type \S+/, 'message type …').replace(/"[^"]*"/g, '"…"').replace(/-?\d+/g, 'N').slice(0, 70)
}

async function startCountingProxy(options: Partial<ProxyOptions> & Record<string, unknown> = {}) {
  const stats = { upgrades: 0, ended: 0, maxLive: 0, outcomes: new Map<string, number>() }
  const proxy = createProxy({
    upstream: UPSTREAM,
    ...options,
    log: (entry: SessionLog) => {
      stats.ended++
      const key = outcomeKey(entry.outcome)
      stats.outcomes.set(key, (stats.outcomes.get(key) ?? 0) + 1)
    },
  } as ProxyOptions)
  // Registered after the proxy's own listener: only observes.
  proxy.server.on('upgrade', () => {
    stats.upgrades++
    stats.maxLive = Math.max(stats.maxLive, stats.upgrades - stats.ended)
  })
  const { port } = await proxy.listen(0, '127.0.0.1')
  const connections = () => new Promise<number>((resolve, reject) => proxy.server.getConnections((err, n) => (err ? reject(err) : resolve(n))))
  // (Object.assign, not a spread: the proxy's getters must stay live.)
  return Object.assign(proxy, { port, stats, connections, url: (path: string) => `ws://127.0.0.1:${port}${path}` })
}
type CountingProxy = Awaited<ReturnType<typeof startCountingProxy>>

/**
 * Postgres backends still serving a connection the proxy opened (found by its client port, so
 * other test files' connections do not count).
 */
async function proxyBackends(): Promise<number> {
  const admin = new pg.Client(pgConfig('trust_user'))
  await admin.connect()
  try {
    const { rows } = await admin.query(`SELECT count(*)::int AS n FROM pg_stat_activity WHERE client_port = ANY($1::int[]) AND pid <> pg_backend_pid()`, [[...upstreams.ports]])
    return rows[0].n
  } finally {
    await admin.end()
  }
}

/** A normal edgepg session through the proxy: connect + query; returns how long it took. */
async function normalQuery(port: number): Promise<number> {
  const started = Date.now()
  const client = new Client({ ...pgConfig('scram_user'), webSocketConstructor: WebSocket as any, wsProxy: () => `ws://127.0.0.1:${port}/v2` })
  client.on('error', () => {})
  try {
    await within(5000, 'an edgepg Client connect', client.connect())
    const { rows } = await within(5000, 'an edgepg query', client.query('SELECT $1::text AS echo', ['still serving']))
    assert.equal(rows[0].echo, 'still serving', 'the query through the proxy returns its row')
  } finally {
    await client.end().catch(() => {})
  }
  return Date.now() - started
}

// ---------------------------------------------------------------------------------------------
// Inputs built from the seeded PRNG (test/support/prng.ts; the wire format itself: test/support/protocol.ts).

type Rng = ReturnType<typeof prng>

const cancelRequest = (r: Rng) => packet(CANCEL_CODE, Buffer.concat([int32(r.int(2 ** 31)), int32(r.int(2 ** 31))]))

const ROLES = ['trust_user', 'scram_user', 'md5_user', 'password_user'] as const
const APP = 'edgepg-fuzz'
function someUser(r: Rng) {
  return r.chance(0.75) ? r.pick(ROLES) : r.pick(['', 'nosuchuser', r.word(r.range(1, 12)), 'ü'.repeat(r.range(1, 40))])
}
function validStartup(r: Rng, user = someUser(r)) {
  const params: Array<[string, string]> = [['user', user]]
  if (r.chance(0.7)) params.push(['database', r.chance(0.9) ? PG.database : r.word(6)])
  params.push(['application_name', APP])
  if (r.chance(0.15)) params.push([r.pick(['client_encoding', 'options', 'DateStyle', 'search_path']), r.pick(['UTF8', '-c work_mem=64kB', 'ISO', 'public'])])
  return startupMessage(params)
}

/** Length values every length field gets tried with. */
const BAD_LENGTHS = [0, 3, 4, 7, 8, 9, 10000, 10001, 65536, 65537, 2 ** 31 - 1, -1, -8, -(2 ** 31)]
const SPECIAL_CODES = [0, 1, -1, 0x7fffffff, -(2 ** 31), 131072 /* 2.0 */, 196607 /* 2.65535 */, 196609 /* 3.1 */, 196610 /* 3.2 */, 262144 /* 4.0 */, 0x0003ffff, 80877100, 80877101, 80877105, 80877106, (1234 << 16) | 5681]

function mutate(r: Rng, buf: Buffer): Buffer {
  let b = Buffer.from(buf)
  const rounds = r.range(1, 3)
  for (let i = 0; i < rounds; i++) {
    switch (r.int(8)) {
      case 0: // bit flips
        for (let j = r.range(1, 4); j > 0 && b.length; j--) b[r.int(b.length)] ^= 1 << r.int(8)
        break
      case 1: // truncation
        b = b.subarray(0, r.int(b.length + 1))
        break
      case 2: // length field set to a bad value
        if (b.length >= 4) b.writeInt32BE(r.pick(BAD_LENGTHS) | 0, 0)
        break
      case 3: // length field off by a little
        if (b.length >= 4) b.writeInt32BE((b.readInt32BE(0) + r.range(-9, 9)) | 0, 0)
        break
      case 4: // a byte overwritten
        if (b.length) b[r.int(b.length)] = r.int(256)
        break
      case 5: {
        // bytes inserted
        const at = r.int(b.length + 1)
        b = Buffer.concat([b.subarray(0, at), r.bytes(r.range(1, 16)), b.subarray(at)])
        break
      }
      case 6: {
        // bytes deleted
        const at = r.int(b.length + 1)
        b = Buffer.concat([b.subarray(0, at), b.subarray(at + r.range(1, 8))])
        break
      }
      case 7: // garbage appended
        b = Buffer.concat([b, r.bytes(r.range(1, 64))])
        break
    }
  }
  return b
}

type Frame = Buffer | { text: string }
interface Case {
  category: string
  frames: Frame[]
  /** 'wait': wait for an answer; 'close' / 'terminate': the client ends the session itself mid-input. */
  end: 'wait' | 'close' | 'terminate'
  closeAfterMs?: number
  protocol?: boolean
  path?: string
}

/** Splits a byte stream into WebSocket frames: whole, random chunks, one byte each, or with empty frames in between. */
function split(r: Rng, data: Buffer, mode = r.pick(['whole', 'whole', 'chunks', 'chunks', 'bytes', 'empties'] as const)): Buffer[] {
  if (mode === 'bytes' && data.length > 4000) mode = 'chunks'
  if (mode === 'whole' || data.length === 0) return [data]
  const frames: Buffer[] = []
  for (let i = 0; i < data.length; ) {
    const n = mode === 'bytes' ? 1 : r.range(1, Math.max(1, Math.min(data.length - i, 512)))
    frames.push(data.subarray(i, i + n))
    if (mode === 'empties' && r.chance(0.5)) frames.push(Buffer.alloc(0))
    i += n
  }
  return frames
}

/** A startup phase that got as far as the proxy asking for the password. */
const startupThen = (r: Rng, after: Buffer) => Buffer.concat([validStartup(r), after])

const GENERATORS: Array<[string, number, (r: Rng) => Omit<Case, 'category'>]> = [
  ['random bytes', 8, (r) => ({ frames: split(r, r.bytes(r.chance(0.9) ? r.range(1, 300) : r.range(300, 20000))), end: 'wait' })],
  ['plausible length + random bytes', 5, (r) => ({ frames: split(r, Buffer.concat([int32(r.range(8, 10000)), r.bytes(r.range(0, 400))])), end: 'wait' })],
  ['mutated StartupMessage', 12, (r) => ({ frames: split(r, mutate(r, validStartup(r))), end: 'wait' })],
  ['mutated SSLRequest', 5, (r) => ({ frames: split(r, mutate(r, sslRequest())), end: 'wait' })],
  ['mutated GSSENCRequest', 5, (r) => ({ frames: split(r, mutate(r, gssencRequest())), end: 'wait' })],
  ['mutated CancelRequest', 5, (r) => ({ frames: split(r, mutate(r, cancelRequest(r))), end: 'wait' })],
  [
    'bad length field',
    8,
    (r) => {
      const p = r.pick([validStartup(r), sslRequest(), gssencRequest(), cancelRequest(r)])
      p.writeInt32BE(r.pick(BAD_LENGTHS) | 0, 0)
      return { frames: split(r, p), end: 'wait' }
    },
  ],
  [
    'truncated packet',
    5,
    (r) => {
      const p = r.pick([validStartup(r), sslRequest(), gssencRequest(), cancelRequest(r)])
      return { frames: split(r, p.subarray(0, r.int(p.length))), end: 'wait' }
    },
  ],
  [
    'unknown protocol code',
    6,
    (r) => {
      const code = r.chance(0.7) ? r.pick(SPECIAL_CODES) : r.int(2 ** 32) | 0
      const body = r.chance(0.5) ? cstrings(['user', 'trust_user', '']) : r.bytes(r.range(0, 40))
      return { frames: split(r, packet(code, body)), end: 'wait' }
    },
  ],
  [
    'params without terminator',
    5,
    (r) => {
      const bodies = [
        Buffer.from(`user\0${r.pick(ROLES)}\0database\0${PG.database}\0`), // final \0 missing
        Buffer.from(`user\0${r.pick(ROLES)}`),
        Buffer.from(r.word(r.range(1, 50))),
        Buffer.from(r.bytes(r.range(1, 100)).map((c) => c || 1)), // no NUL at all
      ]
      return { frames: split(r, packet(PROTOCOL_3, r.pick(bodies))), end: 'wait' }
    },
  ],
  [
    'odd key/value count',
    5,
    (r) => {
      const parts = ['user', r.pick(ROLES), 'database', PG.database, 'application_name', APP].slice(0, r.range(1, 6))
      if (parts.length % 2 === 0) parts.push(r.word(4))
      return { frames: split(r, packet(PROTOCOL_3, Buffer.concat([cstrings(parts), Buffer.from([0])]))), end: 'wait' }
    },
  ],
  [
    'huge params',
    4,
    (r) => {
      const total = r.pick([r.range(9000, 10000), 10000, 10001, r.range(10002, 70000)])
      const params: Array<[string, string]> = [['user', r.pick(ROLES)], ['database', PG.database]]
      const filler = Math.max(1, total - 8 - 1 - cstrings(params.flat()).length - 2 - 'application_name'.length)
      params.push(r.chance(0.5) ? ['application_name', 'x'.repeat(filler)] : ['k'.repeat(Math.ceil(filler / 2)), 'v'.repeat(Math.floor(filler / 2))])
      return { frames: split(r, startupMessage(params), r.pick(['whole', 'chunks'] as const)), end: 'wait' }
    },
  ],
  ['startup, then garbage instead of a password', 6, (r) => ({ frames: split(r, startupThen(r, r.bytes(r.range(1, 200)))), end: 'wait' })],
  [
    'password message with a bad length',
    6,
    (r) => {
      const pw = cstrings([r.chance(0.5) ? PASSWORD : r.word(8)])
      const msg = Buffer.concat([Buffer.from('p'), int32(r.pick([...BAD_LENGTHS, 4 + pw.length - 1, 4 + pw.length + 1, 65536 + 4])), pw])
      return { frames: split(r, startupThen(r, msg)), end: 'wait' }
    },
  ],
  [
    'other message instead of a password',
    4,
    (r) => {
      const msg = r.pick([message('Q', cstrings(['SELECT 1'])), TERMINATE, message('S', Buffer.alloc(0)), message(String.fromCharCode(r.int(256)), r.bytes(r.range(0, 30)))])
      return { frames: split(r, startupThen(r, msg)), end: 'wait' }
    },
  ],
  [
    'text frame',
    5,
    (r) => {
      const before = r.chance(0.5) ? [] : split(r, r.pick([validStartup(r), sslRequest(), r.bytes(r.range(1, 20))]))
      return { frames: [...before, { text: r.pick(['SELECT 1', '', 'user\0trust_user\0\0', r.word(r.range(1, 100))]) }, ...(r.chance(0.5) ? [validStartup(r)] : [])], end: 'wait' }
    },
  ],
  [
    'one-byte frames',
    4,
    (r) => ({ frames: split(r, r.pick([validStartup(r), mutate(r, validStartup(r)), startupThen(r, passwordMessage('wrong')), r.bytes(r.range(1, 600))]), 'bytes'), end: 'wait' }),
  ],
  [
    'garbage after SSLRequest',
    6,
    (r) => {
      const after = r.pick([r.bytes(r.range(1, 300)), Buffer.from([0x16, 0x03, 0x01, 0x00, 0x05, 1, 2, 3, 4, 5]), sslRequest(), gssencRequest(), mutate(r, validStartup(r)), cancelRequest(r)])
      return { frames: [...split(r, sslRequest()), ...split(r, after)], end: 'wait' }
    },
  ],
  [
    'empty frames',
    3,
    (r) => {
      const empties = Array.from({ length: r.range(1, 50) }, () => Buffer.alloc(0))
      return { frames: r.chance(0.5) ? empties : [...empties, ...split(r, mutate(r, validStartup(r)), 'empties')], end: 'wait' }
    },
  ],
  [
    'closing mid-packet',
    6,
    (r) => {
      const p = r.pick([validStartup(r), sslRequest(), cancelRequest(r), startupThen(r, passwordMessage(PASSWORD))])
      return { frames: split(r, p.subarray(0, r.int(p.length))), end: r.pick(['close', 'terminate'] as const), closeAfterMs: r.pick([0, 0, 1, 5, 20]) }
    },
  ],
  [
    'GSSENCRequest sequences',
    4,
    (r) => {
      const n = r.pick([2, 3, 10, 1000])
      const tail = r.pick([Buffer.alloc(0), sslRequest(), validStartup(r), cancelRequest(r)])
      return { frames: split(r, Buffer.concat([...Array.from({ length: n }, gssencRequest), tail]), r.pick(['whole', 'chunks'] as const)), end: 'wait' }
    },
  ],
  [
    'valid CancelRequest / GSSENC then startup',
    2,
    (r) => ({ frames: split(r, r.chance(0.5) ? cancelRequest(r) : Buffer.concat([gssencRequest(), startupThen(r, passwordMessage(r.chance(0.5) ? PASSWORD : 'x'))])), end: 'wait' }),
  ],
  [
    'control: valid login, then Terminate or a wrong password',
    2,
    (r) => {
      const user = r.pick(['trust_user', 'trust_user', 'password_user', 'md5_user', 'scram_user'])
      const right = r.chance(0.7)
      return { frames: split(r, Buffer.concat([validStartup(r, user), passwordMessage(right ? PASSWORD : r.word(8)), TERMINATE])), end: 'wait' }
    },
  ],
]
const TOTAL_WEIGHT = GENERATORS.reduce((n, [, w]) => n + w, 0)

function generate(r: Rng): Case {
  let x = r.int(TOTAL_WEIGHT)
  const [category, , gen] = GENERATORS.find(([, w]) => (x -= w) < 0)!
  return { category, ...gen(r), protocol: r.chance(0.5), path: r.chance(0.5) ? '/v2' : '/v1' }
}

// ---------------------------------------------------------------------------------------------
// One session, raw: frames out, then wait for an ErrorResponse and/or a close.

type Outcome = 'error + close' | 'close' | 'error (no close)' | 'client closed' | 'HANG' | 'open failed'
interface Result {
  outcome: Outcome
  stalled: boolean
  code?: number
}

/** A FATAL or ERROR ErrorResponse anywhere in what the client received. */
function hasErrorResponse(buf: Buffer): boolean {
  for (let i = buf.indexOf(0x45); i >= 0 && i + 6 <= buf.length; i = buf.indexOf(0x45, i + 1)) {
    const len = buf.readInt32BE(i + 1)
    if (len >= 5 && len < 1 << 20 && buf[i + 5] === 0x53 /* 'S' */ && /^S(FATAL|ERROR|PANIC)\0/.test(buf.toString('latin1', i + 5, i + 13))) return true
  }
  return false
}

const TAIL = Buffer.alloc(70_000, 0xff)

function runCase(url: string, c: Case): Promise<Result> {
  return new Promise((resolve) => {
    const ws = new WebSocket(url + c.path, c.protocol ? [SUBPROTOCOL] : [], { perMessageDeflate: false })
    let received = Buffer.alloc(0)
    let errored = false
    let stalled = false
    let clientClosing = false
    let opened = false
    let settled = false
    let timer: NodeJS.Timeout | undefined
    const finish = (outcome: Outcome, code?: number) => {
      if (settled) return
      settled = true
      clearTimeout(timer)
      if (ws.readyState !== ws.CLOSED) ws.terminate()
      resolve({ outcome, stalled, code })
    }
    ws.on('error', () => {}) // a reset after the proxy closed; the close event follows
    ws.on('message', (data: Buffer) => {
      if (received.length < 1 << 16) received = Buffer.concat([received, data])
      if (!errored && hasErrorResponse(received)) {
        errored = true
        if (!stalled) arm(END_MS, () => finish('error (no close)'))
      }
    })
    ws.on('close', (code) => finish(!opened ? 'open failed' : clientClosing ? 'client closed' : errored ? 'error + close' : 'close', code))
    ws.on('unexpected-response', () => finish('open failed'))
    const arm = (ms: number, fn: () => void) => {
      clearTimeout(timer)
      timer = setTimeout(fn, ms)
    }
    ws.on('open', async () => {
      opened = true
      for (const f of c.frames) {
        if (ws.readyState !== ws.OPEN) break
        if (Buffer.isBuffer(f)) ws.send(f, { binary: true })
        else ws.send(f.text, { binary: false })
      }
      if (c.end !== 'wait') {
        if (c.closeAfterMs) await sleep(c.closeAfterMs)
        if (ws.readyState !== ws.OPEN) return
        clientClosing = true
        if (c.end === 'terminate') ws.terminate()
        else ws.close()
        return arm(END_MS, () => finish('HANG'))
      }
      arm(SETTLE_MS, () => {
        // Silent so far: the input was a valid prefix. Complete it with garbage; now it must end.
        stalled = true
        if (ws.readyState === ws.OPEN) ws.send(TAIL)
        arm(END_MS, () => finish(errored ? 'error (no close)' : 'HANG'))
      })
    })
  })
}

async function pool<T>(n: number, concurrency: number, task: (i: number) => Promise<T>, onResult: (i: number, r: T) => void) {
  let next = 0
  await Promise.all(
    Array.from({ length: concurrency }, async () => {
      while (next < n) {
        const i = next++
        onResult(i, await task(i))
      }
    })
  )
}

// ---------------------------------------------------------------------------------------------

describe('hostile startup-phase input', { concurrency: false }, () => {
  let p: CountingProxy
  let baseline: { heap: number }
  before(async () => {
    p = await startCountingProxy()
    // Warm up (module loading, JIT) so the heap baseline is the steady state.
    for (let i = 0; i < 20; i++) await runCase(p.url(''), { category: 'warm-up', frames: [validStartup(prng(i), 'trust_user'), passwordMessage(PASSWORD), TERMINATE], end: 'wait', path: '/v2' })
    await eventually(() => p.stats.ended === p.stats.upgrades, 'warm-up sessions to end')
    baseline = { heap: await heapMB() }
  })
  after(async () => {
    await p?.close()
  })

  test(`${COUNT} random and mutated inputs: each ends with an ErrorResponse and/or a close; nothing leaks`, async (t) => {
    t.diagnostic(`seed ${SEED}`)
    const r = prng(SEED)
    const table = new Map<string, Map<string, number>>()
    const hangs: string[] = []
    let stalledCount = 0
    let maxUpstreams = 0
    let peakHeap = 0
    const sample = setInterval(() => {
      maxUpstreams = Math.max(maxUpstreams, upstreams.open)
      peakHeap = Math.max(peakHeap, process.memoryUsage().heapUsed / MB)
    }, 50)
    const started = Date.now()
    const upgradesBefore = p.stats.upgrades
    await pool(
      COUNT,
      CONCURRENCY,
      async () => {
        const c = generate(r)
        return { c, result: await runCase(p.url(''), c) }
      },
      (i, { c, result }) => {
        const row = table.get(c.category) ?? new Map<string, number>()
        table.set(c.category, row)
        const key = result.stalled ? `${result.outcome} (stalled → tail)` : result.outcome
        row.set(key, (row.get(key) ?? 0) + 1)
        if (result.stalled) stalledCount++
        if ((result.outcome === 'HANG' || result.outcome === 'open failed') && hangs.length < 10) {
          const bytes = Buffer.concat(c.frames.map((f) => (Buffer.isBuffer(f) ? f : Buffer.from(f.text))))
          hangs.push(`#${i} ${c.category} ${result.outcome}: ${c.frames.length} frames, ${bytes.subarray(0, 64).toString('hex')}${bytes.length > 64 ? '…' : ''}`)
        }
      }
    )
    clearInterval(sample)
    const elapsed = Date.now() - started
    await eventually(() => p.stats.ended === p.stats.upgrades, 'every proxy session to end (its log line)', 10000)
    await eventually(() => upstreams.open === 0, 'every upstream socket to Postgres to close', 10000)
    const heapAfter = await heapMB()

    // Report.
    const lines = [`${COUNT} sessions in ${(elapsed / 1000).toFixed(1)} s (seed ${SEED}); ${stalledCount} stalled on a valid prefix and got the tail`]
    for (const [category, row] of [...table].sort()) lines.push(`  ${category}: ${[...row].map(([k, n]) => `${k} ${n}`).join(', ')}`)
    lines.push(`proxy outcomes: ${[...p.stats.outcomes].sort((a, b) => b[1] - a[1]).map(([k, n]) => `${n}× ${k}`).join(' | ')}`)
    lines.push(`max live proxy sessions ${p.stats.maxLive}, max open upstream sockets ${maxUpstreams} (of ${upstreams.opened} dialled)`)
    lines.push(`heap: baseline ${fmt(baseline.heap)}, peak ${fmt(peakHeap)} (sampled, no GC), after ${fmt(heapAfter)} (after GC)`)
    console.log(lines.map((l) => `# ${l}`).join('\n'))

    assert.deepEqual(hangs, [], 'every session ends with an ErrorResponse and/or a close within the bound')
    assert.equal(p.stats.upgrades - upgradesBefore, COUNT, 'every session reached the proxy')
    // (A client may see its session closed a moment before the proxy does: hence the slack.)
    assert.ok(p.stats.maxLive <= 2 * CONCURRENCY, `live sessions stay bounded by the client's concurrency (max ${p.stats.maxLive})`)
    assert.ok(maxUpstreams <= 2 * CONCURRENCY, `open upstream sockets stay bounded (max ${maxUpstreams})`)
    assert.ok(peakHeap - baseline.heap < 100, `heap bounded during the run, garbage included: ${fmt(baseline.heap)} → peak ${fmt(peakHeap)}`)
    assert.ok(heapAfter - baseline.heap < 50, `heap growth bounded: ${fmt(baseline.heap)} → ${fmt(heapAfter)}`)
    assert.ok(heapAfter - baseline.heap < 10, `heap returns near baseline once sessions closed: ${fmt(baseline.heap)} → ${fmt(heapAfter)}`)
    await eventually(async () => (await proxyBackends()) === 0, 'no Postgres backend left serving a connection from the proxy')
    assert.ok((await connectionsOf(p)) === 0, 'no client connection left on the proxy')
    nothingEscaped('random and mutated inputs')
    await normalQuery(p.port)
  })
})

async function connectionsOf(p: CountingProxy) {
  let n = await p.connections()
  const deadline = Date.now() + 3000
  while (n > 0 && Date.now() < deadline) {
    await sleep(25)
    n = await p.connections()
  }
  return n
}

// ---------------------------------------------------------------------------------------------
// Raw frames, written straight to a client's socket: many tiny frames without ws's per-send cost.

/** One masked (key 0: payload unchanged) binary frame, as a client must send it; payload < 126 bytes. */
const rawFrame = (payload: Buffer) => Buffer.concat([Buffer.from([0x82, 0x80 | payload.length, 0, 0, 0, 0]), payload])

function openWs(url: string, protocols: string[] = []): Promise<WebSocket> {
  return within(
    10000,
    `open ${url}`,
    new Promise((resolve, reject) => {
      const ws = new WebSocket(url, protocols, { perMessageDeflate: false })
      ws.once('open', () => resolve(ws))
      ws.once('unexpected-response', (_req, res) => reject(new Error(`HTTP ${res.statusCode} opening ${url}`)))
      ws.once('error', reject)
    })
  )
}

/** Everything a client receives, and how its session ended. */
function watch(ws: WebSocket) {
  const w = { received: Buffer.alloc(0), closed: undefined as undefined | { code: number; at: number }, opened: Date.now() }
  ws.on('message', (d: Buffer) => {
    if (w.received.length < 1 << 16) w.received = Buffer.concat([w.received, d])
  })
  ws.on('error', () => {})
  ws.on('close', (code) => (w.closed = { code, at: Date.now() }))
  return w
}

test('ByteQueue: random pushes (empty, one-byte, large) and reads give back the stream in order', async () => {
  const r = prng(SEED ^ 0x5eed)
  for (let round = 0; round < 20; round++) {
    // The operations first (a push of a chunk, or a read of n bytes), then the whole stream once.
    const ops: Array<Buffer | number> = []
    let pushed = 0
    let read = 0
    for (let op = 0; op < 3000; op++) {
      if (r.chance(0.6)) {
        const chunk = r.bytes(r.pick([0, 1, 1, 1, 2, 3, r.range(1, 300), r.range(300, 5000)]))
        ops.push(chunk)
        pushed += chunk.length
      } else {
        const n = Math.min(r.pick([1, 4, 5, r.range(0, 100), r.range(0, 3000)]), pushed - read)
        ops.push(n)
        read += n
      }
    }
    const stream = Buffer.concat(ops.filter((o): o is Buffer => typeof o !== 'number'))
    const q = new ByteQueue()
    let consumed = 0
    pushed = 0
    for (const [i, op] of ops.entries()) {
      if (typeof op === 'number') {
        const got = await q.read(op)
        assert.ok(got.equals(stream.subarray(consumed, consumed + op)), `read(${op}) at byte ${consumed} returns the next ${op} bytes (round ${round}, op ${i})`)
        consumed += op
      } else {
        q.push(op)
        pushed += op.length
      }
      assert.equal(q.length, pushed - consumed, 'length is what was pushed and not yet read')
    }
    // A pending read is satisfied by later one-byte pushes.
    const pending = q.read(q.length + 500)
    for (let i = 0; i < 500; i++) q.push(Buffer.from([i & 0xff]))
    const tail = await pending
    assert.ok(tail.subarray(-500).equals(Buffer.from(Array.from({ length: 500 }, (_, i) => i & 0xff))), 'a pending read completes with the later bytes in order')
    assert.ok(q.rest().length === 0, 'nothing left over')
  }
})

describe('startup-phase resource bounds', { concurrency: false }, () => {
  let p: CountingProxy
  before(async () => {
    p = await startCountingProxy()
  })
  after(async () => {
    await p?.close()
  })

  test('a message packed with GSSENCRequests gets one "N", then an ErrorResponse and a close (as from Postgres)', async () => {
    const flood = Buffer.concat(Array.from({ length: 8000 }, gssencRequest)) // within the 64 KiB a message may have before login
    const ws = await openWs(p.url('/v2'))
    const w = watch(ws)
    // Event-loop lag while the proxy works through it (the client and the proxy share this process).
    let maxLag = 0
    let last = Date.now()
    const lag = setInterval(() => {
      maxLag = Math.max(maxLag, Date.now() - last - 5)
      last = Date.now()
    }, 5)
    ws.send(flood)
    await eventually(() => w.closed !== undefined, 'the proxy to close the session', 10000)
    clearInterval(lag)
    const answers = w.received.subarray(0, w.received.indexOf(0x45)).toString('latin1')
    assert.equal(answers, 'N', 'GSSENCRequest is refused once; a second is not answered with "N" again')
    assert.ok(hasErrorResponse(w.received), 'then an ErrorResponse')
    assert.match(w.received.toString('latin1'), /unsupported frontend protocol 1234\.5680/, 'the same words as Postgres')
    assert.ok(maxLag < 200, `the proxy never blocks its event loop on it (max lag ${maxLag} ms)`)
    nothingEscaped('GSSENCRequest flood')
  })

  test('any byte as the message type instead of a password message gets a well-formed ErrorResponse', async () => {
    for (const type of [0x00, 0x0a, 0x27, 0x7f, 0xff]) {
      const ws = await openWs(p.url('/v2'))
      const w = watch(ws)
      ws.send(Buffer.concat([startupWithoutPassword(APP)()[0], Buffer.from([type, 0, 0, 0, 4])]))
      await eventually(() => w.closed !== undefined, 'the proxy to close the session')
      // AuthenticationCleartextPassword (9 bytes), then the ErrorResponse: fields until a lone NUL, nothing after.
      const e = w.received.subarray(9)
      assert.equal(e[0], 0x45, `an ErrorResponse for type 0x${type.toString(16)}`)
      const fields = e.subarray(5, 1 + e.readInt32BE(1))
      const parsed = fields.toString('utf8').split('\0')
      assert.deepEqual(parsed.slice(-2), ['', ''], `fields end with the terminator (type 0x${type.toString(16)})`)
      const codes = parsed.slice(0, -2).map((f) => f[0]).join('')
      assert.equal(codes, 'SVCM', `exactly the fields S, V, C, M: no NUL inside a field (type 0x${type.toString(16)}: ${JSON.stringify(fields.toString('latin1'))})`)
      assert.match(parsed[3], /expected a password message, got message type/, 'the message says what came instead')
    }
    nothingEscaped('odd message types')
  })

  test('one-byte and empty frames held by a waiting startup cost memory in proportion to their bytes', async () => {
    const SESSIONS = 10
    const ONE_BYTE = 30_000
    const EMPTY = 60_000
    // Each session: a valid startup (Postgres answers it and waits), then a password message
    // announced as 65,536 bytes long whose body then trickles in one byte per frame, among empty
    // frames. The proxy holds it all, correctly waiting for the rest of the message.
    const stream = Buffer.concat([
      ...Array.from({ length: ONE_BYTE }, (_, i) => rawFrame(Buffer.from([0x61 + (i % 26)]))),
      ...Array.from({ length: EMPTY }, () => rawFrame(Buffer.alloc(0))),
    ])
    const proxySockets: net.Socket[] = []
    const onUpgrade = (_req: unknown, socket: net.Socket) => proxySockets.push(socket)
    p.server.on('upgrade', onUpgrade)
    const before = await heapMB()
    const externalBefore = process.memoryUsage().external / MB
    const clients: WebSocket[] = []
    try {
      for (let i = 0; i < SESSIONS; i++) {
        const ws = await openWs(p.url('/v2'))
        watch(ws)
        clients.push(ws)
        ws.send(startupWithoutPassword(APP)()[0])
        ws.send(Buffer.concat([Buffer.from('p'), int32(65536)]))
        ;(ws as any)._socket.write(stream)
      }
      const sent = stream.length * SESSIONS
      await eventually(() => proxySockets.reduce((n, s) => n + s.bytesRead, 0) >= sent, 'the proxy to read every frame', 20000)
      const during = await heapMB()
      const externalDuring = process.memoryUsage().external / MB
      console.log(
        `# ${SESSIONS} sessions × (${ONE_BYTE} one-byte + ${EMPTY} empty frames) held: heap ${fmt(before)} → ${fmt(during)}, external ${fmt(externalBefore)} → ${fmt(externalDuring)}`
      )
      assert.ok(clients.every((ws) => ws.readyState === ws.OPEN), 'the sessions are still open, waiting for the rest of the password message')
      assert.ok(during - before < 16, `heap while held stays small: ${fmt(before)} → ${fmt(during)} for ${fmt((SESSIONS * ONE_BYTE) / MB)} of payload`)
      assert.ok(externalDuring - externalBefore < 16, `buffers while held stay small: ${fmt(externalBefore)} → ${fmt(externalDuring)}`)
    } finally {
      p.server.off('upgrade', onUpgrade)
      for (const ws of clients) ws.terminate()
    }
    await eventually(() => p.stats.ended === p.stats.upgrades, 'the sessions to end')
    await eventually(() => upstreams.open === 0, 'their upstream sockets to close')
    nothingEscaped('tiny frames')
  })
})

// ---------------------------------------------------------------------------------------------

/** Raw TCP connections that send part of an HTTP upgrade request, then nothing. */
async function partialUpgrades(port: number, n: number, onConnect?: (s: net.Socket) => void): Promise<net.Socket[]> {
  const request = `GET /v2 HTTP/1.1\r\nHost: 127.0.0.1:${port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Ver`
  const sockets: net.Socket[] = []
  await pool(n, CONCURRENCY, (i) =>
    within(10000, 'a TCP connect', new Promise<net.Socket>((resolve, reject) => {
      const s = net.connect(port, '127.0.0.1', () => {
        onConnect?.(s)
        s.write(request.slice(0, 20 + (i % (request.length - 20))))
        resolve(s)
      })
      s.once('error', reject)
    })), (_, s) => {
      s.on('error', () => {})
      sockets.push(s)
    })
  return sockets
}

/** WebSocket sessions that send `first` and then stall. */
async function stalledSessions(url: string, n: number, first: (i: number) => Buffer[], onOpen?: (ws: WebSocket) => void): Promise<WebSocket[]> {
  const sockets: WebSocket[] = []
  await pool(n, CONCURRENCY, (i) => openWs(url, i % 2 ? [SUBPROTOCOL] : []).then((ws) => {
    onOpen?.(ws)
    for (const f of first(i)) ws.send(f)
    return ws
  }), (_, ws) => {
    ws.on('error', () => {})
    sockets.push(ws)
  })
  return sockets
}

const partialStartup = (i: number) => {
  const full = validStartup(prng(i), 'trust_user')
  return [full.subarray(0, 4 + (i % (full.length - 4)))] // the length, and part of the rest
}
const HALF_OPEN_APP = 'edgepg-fuzz-halfopen'
const startupWithoutPassword = (app: string) => () => [startupMessage([['user', 'trust_user'], ['database', PG.database], ['application_name', app]])]

describe('floods of half-open connections', { concurrency: false }, () => {
  test('500 stalled HTTP upgrades + 500 stalled startups + 100 sessions waiting for a password: still serving, then all released', async (t) => {
    // Limits raised above the flood (the defaults would refuse it with 429/503, which is their job)
    // and the handshake timeout out of the way: here the proxy must hold them, bounded, until they go.
    // No warm backends: every upstream socket and backend must be gone at the end (the pool's are test/pool.test.ts's).
    const p = await startCountingProxy({ maxSessions: 5000, maxSessionsPerIp: 5000, handshakeTimeoutMs: 120_000, pool: { enabled: false } })
    let raw: net.Socket[] = []
    let stalled: WebSocket[] = []
    let waiting: WebSocket[] = []
    try {
      const base = { heap: await heapMB(), connections: await p.connections(), upstreams: upstreams.open }
      const started = Date.now()
      raw = await partialUpgrades(p.port, 500)
      stalled = await stalledSessions(p.url('/v2'), 500, partialStartup)
      waiting = await stalledSessions(p.url('/v1'), 100, startupWithoutPassword(HALF_OPEN_APP))
      const opened = Date.now() - started
      // None of them costs Postgres a connection: the proxy connects once a login is in (with auth offload, its password too).
      await sleep(500)
      assert.equal(upstreams.open - base.upstreams, 0, 'no upstream socket for a session whose login is not in')
      assert.equal(await backends(HALF_OPEN_APP), 0, 'no Postgres backend for a session waiting for its password')

      const queryMs = await normalQuery(p.port)
      const heapFlooded = await heapMB()
      const connections = await p.connections()

      for (const s of raw) s.destroy()
      stalled.forEach((ws, i) => (i % 2 ? ws.close() : ws.terminate()))
      waiting.forEach((ws, i) => (i % 2 ? ws.close() : ws.terminate()))
      const closedAt = Date.now()
      await eventually(() => p.stats.ended === p.stats.upgrades, 'every session to end', 10000)
      await eventually(async () => (await p.connections()) <= base.connections, 'every client connection to close', 10000)
      await eventually(() => upstreams.open === base.upstreams, 'every upstream socket to close', 10000)
      await eventually(async () => (await backends(HALF_OPEN_APP)) === 0, 'the waiting backends to exit', 10000)
      await eventually(async () => (await proxyBackends()) === 0, 'no Postgres backend left serving a connection from the proxy', 10000)
      const releasedMs = Date.now() - closedAt
      const heapAfter = await heapMB()
      const sessionCount = (p as { sessionCount?: number }).sessionCount

      const report = `half-open flood: opened in ${opened} ms; ${connections} client connections, ${upstreams.maxOpen} max upstream sockets; ` +
        `a normal query took ${queryMs} ms; released in ${releasedMs} ms; heap ${fmt(base.heap)} → ${fmt(heapFlooded)} flooded → ${fmt(heapAfter)} after`
      console.log(`# ${report}`)
      t.diagnostic(report)
      assert.ok(connections >= 1100, `the proxy held the whole flood (${connections} connections)`)
      assert.ok(queryMs < 3000, `a normal query through the flooded proxy is prompt (${queryMs} ms)`)
      assert.ok(heapFlooded - base.heap < 50, `heap bounded under the flood: ${fmt(base.heap)} → ${fmt(heapFlooded)}`)
      assert.ok(heapAfter - base.heap < 10, `heap back near baseline: ${fmt(base.heap)} → ${fmt(heapAfter)}`)
      if (sessionCount !== undefined) assert.equal(sessionCount, 0, 'the proxy counts no session left')
      nothingEscaped('half-open flood')
    } finally {
      for (const s of raw) s.destroy()
      for (const ws of [...stalled, ...waiting]) ws.terminate()
      await p.close()
    }
  })

  test('handshakeTimeoutMs: 500 — the proxy itself closes stalled sessions within ~1 s', async (t) => {
    const p = await startCountingProxy({ handshakeTimeoutMs: 500 })
    const app = 'edgepg-fuzz-timeout'
    const sessions: Array<ReturnType<typeof watch>> = []
    const sockets: WebSocket[] = []
    let raw: net.Socket[] = []
    try {
      for (const [n, first] of [[20, partialStartup], [20, startupWithoutPassword(app)], [20, () => []]] as const) {
        sockets.push(...(await stalledSessions(p.url('/v2'), n, first, (ws) => sessions.push(watch(ws)))))
      }
      // Stalled HTTP upgrades: from connect to the proxy's close, per socket.
      const upgradeMs = new Map<net.Socket, number>()
      raw = await partialUpgrades(p.port, 20, (s) => {
        const at = Date.now()
        s.once('close', () => upgradeMs.set(s, Date.now() - at))
      })
      const bound = 1500
      await eventually(() => sessions.every((s) => s.closed) && upgradeMs.size === raw.length, 'the proxy to close every stalled session and upgrade', 2 * bound).catch(() => {})
      const late = sessions.filter((s) => !s.closed || s.closed.at - s.opened > bound)
      const slowest = Math.max(...sessions.map((s) => (s.closed ? s.closed.at - s.opened : Infinity)))
      const lateUpgrades = raw.filter((s) => !(upgradeMs.get(s)! <= bound))
      const slowestUpgrade = Math.max(...raw.map((s) => upgradeMs.get(s) ?? Infinity))
      const codes = [...new Set(sessions.map((s) => s.closed?.code))].join(', ')
      const withError = sessions.filter((s) => hasErrorResponse(s.received)).length
      const report = `handshake timeout 500 ms: ${sessions.length - late.length}/${sessions.length} stalled sessions closed by the proxy within ${bound} ms ` +
        `(slowest ${slowest} ms, close codes ${codes}, ${withError} with an ErrorResponse); ${raw.length - lateUpgrades.length}/${raw.length} stalled HTTP upgrades (slowest ${slowestUpgrade} ms)`
      console.log(`# ${report}`)
      t.diagnostic(report)
      assert.equal(late.length, 0, `every stalled session is closed by the proxy within ~1 s of its handshake timeout: ${report}`)
      assert.equal(lateUpgrades.length, 0, `every stalled HTTP upgrade is dropped by the proxy within ~1 s too: ${report}`)
      await eventually(() => p.stats.ended === p.stats.upgrades, 'the sessions to end')
      await eventually(() => upstreams.open === 0, 'their upstream sockets to close')
      await eventually(async () => (await backends(app)) === 0, 'their backends to exit')
      nothingEscaped('handshake timeout')
    } finally {
      for (const s of raw) s.destroy()
      for (const ws of sockets) ws.terminate()
      await p.close()
    }
  })
})
