/**
 * edgepg-proxy against its requirement: routes (/v1, /v2), the allow-list (never an open relay),
 * binary-only frames, backpressure both ways, TCP_NODELAY, the session log, an unreachable
 * upstream, the CLI, and @neondatabase/serverless pointed at it. Loopback only.
 *
 * No seam in the proxy is needed: the upstream TCP sockets are observed by wrapping `net.connect`
 * for the length of a test (`captureUpstreams`), and the proxy's client-facing socket is picked
 * up from its http server's 'upgrade' event (`startLocalProxy`).
 */
import { test, describe, before, after } from 'node:test'
import assert from 'node:assert/strict'
import net from 'node:net'
import { spawn, type ChildProcess } from 'node:child_process'
import { createHash } from 'node:crypto'
import { chmod, mkdir, mkdtemp, readFile, rm } from 'node:fs/promises'
import { readFileSync } from 'node:fs'
import { join } from 'node:path'
import { fileURLToPath } from 'node:url'
import { setTimeout as sleep } from 'node:timers/promises'
import type { Duplex } from 'node:stream'
import { WebSocket } from 'ws'
import pg from 'pg'
import { Client as NeonClient, Pool as NeonPool, neonConfig } from '@neondatabase/serverless'
import { createProxy, type ProxyOptions, type SessionLog } from '../proxy/index'
import { Client } from '../src/index'
import { PASSWORD, freePort } from './support/stack'
import { pgConfig, testPostgres, eventually, tryUpgrade, within } from './support/helpers'
import { TERMINATE, backendReader, bigResultQuery, bigResultRowError, passwordMessage, queryMessage, startupMessage } from './support/protocol'

const ROOT = fileURLToPath(new URL('..', import.meta.url))
const PG = testPostgres()
const UPSTREAM = `${PG.host}:${PG.port}`

// ---------------------------------------------------------------------------------------------
// Helpers

/** A proxy in this process that also records each upgrade request's URL and raw socket. */
async function startLocalProxy(options: Partial<ProxyOptions> = {}) {
  const logs: SessionLog[] = []
  const proxy = createProxy({ upstream: UPSTREAM, log: (entry) => logs.push(entry), ...options })
  const upgrades: Array<{ url: string; socket: Duplex }> = []
  // Registered after the proxy's own listener, so it only observes.
  proxy.server.on('upgrade', (req, socket) => upgrades.push({ url: req.url ?? '', socket }))
  const { port } = await proxy.listen(0, '127.0.0.1')
  return { ...proxy, port, logs, upgrades, url: (path: string) => `ws://127.0.0.1:${port}${path}` }
}
type LocalProxy = Awaited<ReturnType<typeof startLocalProxy>>

async function withProxy<T>(options: Partial<ProxyOptions>, fn: (p: LocalProxy) => Promise<T>): Promise<T> {
  const p = await startLocalProxy(options)
  try {
    return await fn(p)
  } finally {
    await p.close()
  }
}

/** Opens a WebSocket; resolves with its HTTP status (101 when it opened) and, on refusal, the body. */
function upgrade(url: string, headers?: Record<string, string>) {
  return within(5000, `upgrade ${url}`, tryUpgrade(url, { headers }))
}

/** Status of an upgrade attempt; closes the WebSocket if it opened. */
async function statusOf(url: string, headers?: Record<string, string>) {
  const { status, ws } = await upgrade(url, headers)
  if (ws) await closeWs(ws)
  return status
}

async function openWs(url: string): Promise<WebSocket> {
  const { status, body, ws } = await upgrade(url)
  if (!ws) throw new Error(`expected ${url} to open, got HTTP ${status}: ${body}`)
  return ws
}

function closed(ws: WebSocket): Promise<{ code: number; reason: string }> {
  if (ws.readyState === ws.CLOSED) return Promise.resolve({ code: -1, reason: 'already closed' })
  return within(5000, 'WebSocket close', new Promise((resolve) => ws.once('close', (code, reason) => resolve({ code, reason: reason.toString() }))))
}

async function closeWs(ws: WebSocket) {
  if (ws.readyState === ws.CLOSED) return
  const done = closed(ws)
  ws.close()
  await done.catch(() => ws.terminate())
}

/** AuthenticationOk, ReadyForQuery: a login accepted. */
const LOGGED_IN = Buffer.from([0x52, 0, 0, 0, 8, 0, 0, 0, 0, 0x5a, 0, 0, 0, 5, 0x49])

/**
 * A TCP server on loopback standing in for "something else listening". With `login`, it plays
 * Postgres for the startup (reads the StartupMessage, says AuthenticationOk and ReadyForQuery), so
 * the proxy counts the session as logged in; what comes after is the test's.
 */
async function throwaway(onConnection?: (s: net.Socket) => void, { login = false } = {}) {
  const sockets = new Set<net.Socket>()
  const received: Buffer[] = []
  let connections = 0
  const then = (s: net.Socket) => (onConnection ? onConnection(s) : s.on('data', (d) => received.push(d)))
  const server = net.createServer((s) => {
    connections++
    sockets.add(s)
    s.on('close', () => sockets.delete(s))
    s.on('error', () => {})
    if (!login) return then(s)
    let head = Buffer.alloc(0)
    const readStartup = (d: Buffer) => {
      head = Buffer.concat([head, d])
      if (head.length < 4 || head.length < head.readInt32BE(0)) return
      s.off('data', readStartup)
      s.write(LOGGED_IN)
      const rest = head.subarray(head.readInt32BE(0))
      then(s)
      if (rest.length) s.unshift(rest)
    }
    s.on('data', readStartup)
  })
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve))
  const { port } = server.address() as net.AddressInfo
  return {
    port,
    address: `127.0.0.1:${port}`,
    received,
    sockets,
    get connections() {
      return connections
    },
    close: () => {
      for (const s of sockets) s.destroy()
      return new Promise<void>((resolve) => server.close(() => resolve()))
    },
  }
}

/**
 * Records every socket that connects to `port` (the proxy's upstream; the test's own clients dial
 * the proxy's port, so they are not recorded) and the arguments given, until `restore()`.
 * Test-only; the proxy is unchanged.
 */
function captureUpstreams(port: number) {
  const calls: Array<{ args: unknown[]; socket: net.Socket }> = []
  const original = net.Socket.prototype.connect
  net.Socket.prototype.connect = function (this: net.Socket, ...args: any[]) {
    // net.connect() hands its arguments on already normalized: [options, callback].
    const first = Array.isArray(args[0]) ? args[0][0] : args[0]
    const target = typeof first === 'object' && first !== null ? first.port : first
    if (Number(target) === port) calls.push({ args: Array.isArray(args[0]) ? args[0] : args, socket: this })
    return original.apply(this, args as any)
  } as typeof original
  return {
    calls,
    async socket(i = 0): Promise<net.Socket> {
      await eventually(() => calls.length > i, `the proxy to open upstream connection #${i + 1} to port ${port}`)
      return calls[i].socket
    },
    restore() {
      net.Socket.prototype.connect = original
    },
  }
}

/** An edgepg client reaching the test Postgres over the given WebSocket URL. */
function edgeClient(url: string | ((host: string, port: number) => string), extra: Record<string, unknown> = {}) {
  return new Client({ ...pgConfig('scram_user'), webSocketConstructor: WebSocket as any, wsProxy: typeof url === 'string' ? () => url : url, ...extra })
}

async function queryVia(url: string | ((host: string, port: number) => string), extra: Record<string, unknown> = {}) {
  const client = edgeClient(url, extra)
  await within(10000, `connect via ${url}`, client.connect())
  try {
    const { rows } = await client.query('SELECT inet_server_port() AS port, current_user AS u, $1::text AS echo', ['via proxy'])
    return rows[0]
  } finally {
    await client.end()
  }
}

// --- The Postgres wire protocol by hand (test/support/protocol.ts), for clients that must control their own reading.

/** A StartupMessage for the test Postgres's database. */
const startup = (user: string, appName: string) => startupMessage({ user, database: PG.database, application_name: appName })

/** A raw WebSocket session speaking the protocol as trust_user, counting bytes both ways. */
async function rawSession(url: string, appName: string) {
  const ws = await openWs(url)
  const s = {
    ws,
    sent: 0,
    received: 0,
    ready: 0,
    errors: [] as string[],
    send(data: Buffer) {
      s.sent += data.length
      ws.send(data)
    },
    /** Resolves at the next ReadyForQuery after `n` of them have been seen in total. */
    readyCount(n: number) {
      return eventually(() => s.ready >= n || s.errors.length > 0, `ReadyForQuery #${n}`).then(() => assert.deepEqual(s.errors, []))
    },
  }
  const read = backendReader((type, body) => {
    if (type === 'Z') s.ready++
    if (type === 'E') s.errors.push(body.toString('latin1'))
  })
  ws.on('message', (data: Buffer) => {
    s.received += data.length
    read(data)
  })
  return s
}

// --- CLI processes, always killed.

const children = new Set<ChildProcess>()
after(() => {
  for (const child of children) {
    try {
      if ((child as any).group) process.kill(-child.pid!, 'SIGKILL')
      else child.kill('SIGKILL')
    } catch {}
  }
})

// One process (--workers 1) unless a test asks for more: these tests are about what one proxy does.
const cleanEnv = { ...Object.fromEntries(Object.entries(process.env).filter(([k]) => !k.startsWith('EDGEPG_') || k === 'EDGEPG_TEST_PG')), EDGEPG_WORKERS: '1' }

function runCli(args: string[], { env = {}, command, group = false }: { env?: Record<string, string>; command: string[]; group?: boolean }) {
  const child = spawn(command[0], [...command.slice(1), ...args], { cwd: ROOT, env: { ...cleanEnv, ...env }, stdio: ['ignore', 'pipe', 'pipe'], detached: group })
  ;(child as any).group = group
  children.add(child)
  const out = { stdout: '', stderr: '' }
  child.stdout!.setEncoding('utf8').on('data', (c: string) => (out.stdout += c))
  child.stderr!.setEncoding('utf8').on('data', (c: string) => (out.stderr += c))
  const exited = new Promise<{ code: number | null; signal: NodeJS.Signals | null }>((resolve) =>
    child.once('close', (code, signal) => {
      children.delete(child)
      resolve({ code, signal })
    })
  )
  return {
    child,
    out,
    exit: (ms = 15000) => within(ms, `edgepg-proxy ${args.join(' ')} to exit`, exited),
    /** Waits for the JSON "listening" line; returns the port. */
    async listening(ms = 15000): Promise<number> {
      await eventually(() => /"listening"/.test(out.stdout) || child.exitCode !== null, 'the CLI to print its listening line', ms)
      const line = out.stdout.split('\n').find((l) => l.includes('"listening"'))
      if (!line) throw new Error(`the CLI exited early (${child.exitCode}): ${out.stderr}`)
      return Number(JSON.parse(line).listening.split(':').pop())
    },
  }
}

// ---------------------------------------------------------------------------------------------

describe('routes and the allow-list', () => {
  let p: LocalProxy
  let other: Awaited<ReturnType<typeof throwaway>>
  before(async () => {
    p = await startLocalProxy()
    other = await throwaway()
  })
  after(async () => {
    await p.close()
    await other.close()
  })

  test('/v2, /v1 and /v1?address=<upstream> all relay to the upstream Postgres', async () => {
    const routes = ['/v2', '/v1', `/v1?address=${UPSTREAM}`, `/v1?address=${encodeURIComponent(UPSTREAM)}`]
    for (const route of routes) {
      const row = await queryVia(p.url(route))
      assert.deepEqual(row, { port: PG.port, u: 'scram_user', echo: 'via proxy' }, route)
    }
    // edgepg's own string form appends ?address=host:port to /v1.
    const client = new Client({ ...pgConfig('scram_user'), webSocketConstructor: WebSocket as any, wsProxy: `127.0.0.1:${p.port}/v1`, useSecureWebSocket: false })
    await client.connect()
    assert.equal((await client.query('SELECT 1 AS one')).rows[0].one, 1)
    await client.end()
    assert.equal(p.upgrades.at(-1)!.url, `/v1?address=${encodeURIComponent(UPSTREAM)}`)
    assert.equal(other.connections, 0)
  })

  test('/v1?address=<another listening port> is 403 unless allowed, and then relayed to exactly it', async () => {
    const refused = await upgrade(p.url(`/v1?address=${other.address}`))
    assert.equal(refused.status, 403)
    assert.match(refused.body, new RegExp(other.address))
    // The ws error message form, as browsers and the drivers see it.
    await assert.rejects(
      new Promise((resolve, reject) => {
        const ws = new WebSocket(p.url(`/v1?address=${other.address}`))
        ws.once('open', resolve)
        ws.once('error', reject)
      }),
      /Unexpected server response: 403/
    )
    assert.equal(other.connections, 0, 'a refused address must not even be dialled')

    await withProxy({ allow: [other.address], authOffload: false }, async (allowed) => {
      const ws = await openWs(allowed.url(`/v1?address=${other.address}`))
      const reply = new Promise<Buffer>((resolve) => ws.once('message', (d: Buffer) => resolve(d)))
      const hello = startup('trust_user', 'edgepg-allowed')
      ws.send(hello)
      await eventually(() => Buffer.concat(other.received).equals(hello), 'the startup to reach the allowed server')
      assert.equal(other.connections, 1)
      for (const s of other.sockets) s.write('pong')
      assert.equal((await within(5000, 'reply', reply)).toString(), 'pong')
      await closeWs(ws)

      // The allow-list adds exactly that address; /v2 still means the upstream, other ports are still refused.
      assert.deepEqual(await queryVia(allowed.url('/v2')), { port: PG.port, u: 'scram_user', echo: 'via proxy' })
      assert.equal(await statusOf(allowed.url(`/v1?address=127.0.0.1:${other.port === 65535 ? 65534 : other.port + 1}`)), 403)
      assert.equal(await statusOf(allowed.url(`/v1?address=localhost:${other.port}`)), 403)
      assert.equal(other.connections, 1)
    })
  })

  test('never an open relay: every address that is not the upstream or allowed is refused without dialling', async () => {
    const dialled = other.connections
    const attempts = [
      other.address,
      `127.0.0.1:${PG.port === 65535 ? 65534 : PG.port + 1}`,
      '127.0.0.1:22',
      '127.0.0.1:80',
      `localhost:${PG.port + 1}`, // (a loopback name stands for the upstream only at its port: test/upstream-rule.test.ts)
      `0.0.0.0:${PG.port}`,
      `127.0.0.1`, // no port means 5432 (unless that is the upstream's)
      '169.254.169.254:80',
      encodeURIComponent(other.address),
    ].filter((a) => !(a === '127.0.0.1' && PG.port === 5432))
    for (const address of attempts) {
      assert.equal(await statusOf(p.url(`/v1?address=${address}`)), 403, `/v1?address=${address}`)
      assert.equal(await statusOf(p.url(`/v2?address=${address}`)), 403, `/v2?address=${address}`)
    }
    // A repeated parameter cannot smuggle a second address past the check.
    assert.equal(await statusOf(p.url(`/v1?address=${other.address}&address=${UPSTREAM}`)), 403)
    assert.equal(await statusOf(p.url(`/v1?address=${UPSTREAM}&address=${other.address}`)), 101)
    // /v2 routes by the proxy's configuration, never by the Host header a client sends.
    assert.deepEqual(await queryVia(() => p.url('/v2')), { port: PG.port, u: 'scram_user', echo: 'via proxy' })
    assert.equal(await statusOf(p.url('/v2'), { host: other.address }), 101)
    assert.equal(other.connections, dialled)
  })

  test('unknown paths are 404, a malformed address is 400, plain HTTP is 426', async () => {
    for (const path of ['/', '/v3', '/v1/extra', '/v2x', '/proxy?address=' + UPSTREAM]) {
      const { status } = await upgrade(p.url(path))
      assert.equal(status, 404, path)
    }
    for (const address of ['nonsense:port', '127.0.0.1:0', '127.0.0.1:65536', '127.0.0.1:-1', '[::1', ':5432', '127.0.0.1:5432:1']) {
      const { status, body } = await upgrade(p.url(`/v1?address=${encodeURIComponent(address)}`))
      assert.equal(status, 400, address)
      assert.match(body, /invalid/, address)
    }
    const res = await fetch(`http://127.0.0.1:${p.port}/v2`)
    assert.equal(res.status, 426)
    await res.text()
    // A plain GET is answered with what the upgrade is refused with, for any page to read (a browser's client asks it why).
    for (const path of ['/v3', `/v2?address=${encodeURIComponent('127.0.0.9:5432')}`, '/v1?address=nonsense:port']) {
      const refused = await upgrade(p.url(path))
      const asked = await fetch(`http://127.0.0.1:${p.port}${path}`)
      assert.equal(asked.status, refused.status, path)
      assert.equal(asked.headers.get('access-control-allow-origin'), '*', path)
      assert.equal((await asked.text()).trim(), refused.body.trim(), path)
    }
  })
})

describe('frames', () => {
  test('text frames are refused with close code 1003', async () => {
    await withProxy({}, async (p) => {
      const ws = await openWs(p.url('/v2'))
      const done = closed(ws)
      ws.send('SELECT 1')
      ws.send(Buffer.from('after the refusal'))
      assert.equal((await done).code, 1003)
      await eventually(() => p.logs.length === 1, 'the session to end')
      assert.match(p.logs[0].outcome, /text/)
      assert.equal(p.logs[0].bytesIn, 0, 'nothing is relayed once a text frame was refused')
    })
  })

  test('a message over maxMessageBytes closes with 1009; one at the limit is relayed', async () => {
    const sink = await throwaway(undefined, { login: true })
    try {
      await withProxy({ upstream: sink.address, maxMessageBytes: 4096, authOffload: false }, async (p) => {
        const loggedIn = async () => {
          const ws = await openWs(p.url('/v2'))
          const answer = new Promise((resolve) => ws.once('message', resolve))
          ws.send(startup('trust_user', 'edgepg-max-message'))
          await answer
          return ws
        }
        const ok = await loggedIn()
        ok.send(Buffer.alloc(4096, 1))
        await eventually(() => Buffer.concat(sink.received).length === 4096, 'a 4096-byte message to be relayed')
        await closeWs(ok)
        const ws = await loggedIn()
        const done = closed(ws)
        ws.send(Buffer.alloc(4097, 2))
        assert.equal((await done).code, 1009)
        assert.equal(Buffer.concat(sink.received).length, 4096)
      })
    } finally {
      await sink.close()
    }
  })

  test('a large client message (8 MiB parameter) reaches Postgres intact', async () => {
    await withProxy({}, async (p) => {
      const client = edgeClient(p.url('/v2'))
      await client.connect()
      try {
        const big = 'abcdefghij'.repeat(800_000) + 'end'
        const { rows } = await client.query('SELECT length($1::text) AS n, md5($1::text) AS h', [big])
        assert.deepEqual(rows[0], { n: big.length, h: createHash('md5').update(big).digest('hex') })
      } finally {
        await client.end()
      }
    })
  })
})

describe('backpressure', () => {
  test('Postgres → client: a client that stops reading pauses the upstream socket, buffering stays bounded, and every row arrives once it reads', { timeout: 30000 }, async () => {
    const ROWS = 120_000 // 1000-byte rows: ~120 MB, far more than loopback socket buffers hold
    const LIMIT = 3 << 20 // "a few MB": the proxy pauses Postgres at 1 MiB queued
    const appName = `edgepg-bp-${process.pid}`
    const admin = new pg.Client(pgConfig('trust_user'))
    await admin.connect()
    const capture = captureUpstreams(PG.port)
    const p = await startLocalProxy({ authOffload: false })
    let sampler: NodeJS.Timeout | undefined
    let ws: WebSocket | undefined
    try {
      ws = await openWs(p.url('/v2'))
      let received = 0
      let rows = 0
      let firstBad = ''
      let tag = ''
      let ready = 0
      const read = backendReader((type, body) => {
        if (type === 'D') {
          rows++
          if (!firstBad) firstBad = bigResultRowError(body, rows)
        } else if (type === 'C') tag = body.toString('latin1', 0, body.length - 1)
        else if (type === 'Z') ready++
        else if (type === 'E') firstBad ||= `error: ${body.toString('latin1')}`
      })
      ws.on('message', (d: Buffer) => {
        received += d.length
        read(d)
      })
      ws.send(Buffer.concat([startup('trust_user', appName), queryMessage(bigResultQuery(ROWS))]))
      ws.pause() // stop reading: the kernel buffers fill, then the proxy's send queue

      const tcp = await capture.socket()
      await eventually(() => !tcp.connecting, 'the upstream connection')
      assert.equal(tcp.remotePort, PG.port)
      const clientSide = p.upgrades[0].socket as net.Socket
      let maxQueued = 0
      let pausedSeen = false
      const sample = () => {
        maxQueued = Math.max(maxQueued, clientSide.writableLength)
        pausedSeen ||= tcp.isPaused()
      }
      tcp.on('data', sample) // after the proxy's own listener: sees the queue right after each send
      sampler = setInterval(sample, 2)

      // Backpressure reaches Postgres itself: its backend blocks writing to the proxy.
      await eventually(async () => {
        const { rows } = await admin.query('SELECT wait_event FROM pg_stat_activity WHERE application_name = $1', [appName])
        return rows[0]?.wait_event === 'ClientWrite'
      }, 'the Postgres backend to block in ClientWrite while the client is not reading', 10000)
      // (Right then it may be between a resume, as the last chunk reached the kernel, and the next pause.)
      await eventually(() => tcp.isPaused(), 'the proxy to pause its upstream socket while the client is not reading', 2000)
      await sleep(300)
      assert.ok(tcp.isPaused(), 'the upstream socket stays paused while the client is not reading')
      assert.ok(maxQueued < LIMIT, `the proxy queued ${maxQueued} bytes for a client that is not reading`)
      assert.ok(received < ROWS * 1000 * 0.5, `the client got ${received} bytes while paused`)

      ws.resume()
      await eventually(() => ready >= 2 || !!firstBad, 'the whole result once the client reads again', 20000)
      assert.equal(firstBad, '')
      assert.equal(rows, ROWS)
      assert.equal(tag, `SELECT ${ROWS}`)
      assert.ok(pausedSeen, 'the upstream socket was seen paused')
      await eventually(() => !tcp.isPaused(), 'the proxy to resume its upstream socket')
      assert.ok(maxQueued < LIMIT, `the proxy queued up to ${maxQueued} bytes`)

      const done = closed(ws)
      ws.send(TERMINATE)
      assert.equal((await done).code, 1000)
      await eventually(() => p.logs.length === 1, 'the session log')
      assert.ok(p.logs[0].bytesOut > ROWS * 1000, `bytesOut ${p.logs[0].bytesOut}`)
    } finally {
      clearInterval(sampler)
      capture.restore()
      ws?.terminate()
      await p.close()
      await admin.end()
    }
  })

  test('client → Postgres: a slow upstream pauses reading from the WebSocket; all bytes arrive in order once it reads', { timeout: 30000 }, async () => {
    const SIZE = 512 << 10
    const COUNT = 64 // 32 MiB: more than the loopback buffers on the way hold
    let upstreamSide: net.Socket | undefined
    const slow = await throwaway(
      (s) => {
        s.pause() // logs in, then never reads (until told to)
        upstreamSide = s
      },
      { login: true }
    )
    const capture = captureUpstreams(slow.port)
    const p = await startLocalProxy({ upstream: slow.address, authOffload: false })
    let ws: WebSocket | undefined
    let sampler: NodeJS.Timeout | undefined
    try {
      ws = await openWs(p.url('/v2'))
      const answer = new Promise((resolve) => ws!.once('message', resolve))
      ws.send(startup('trust_user', 'edgepg-slow'))
      await answer
      const messages = Array.from({ length: COUNT }, (_, i) => {
        const b = Buffer.alloc(SIZE, i % 251)
        b.writeUInt32BE(i, 0)
        return b
      })
      for (const m of messages) ws.send(m)

      const tcp = await capture.socket()
      const clientSide = p.upgrades[0].socket as net.Socket
      let maxUpstreamQueue = 0
      sampler = setInterval(() => (maxUpstreamQueue = Math.max(maxUpstreamQueue, tcp.writableLength)), 2)
      await eventually(() => clientSide.isPaused(), 'the proxy to stop reading from the WebSocket while tcp.write() returns false')
      assert.ok(tcp.writableNeedDrain, 'the proxy paused the WebSocket because the upstream socket is full')
      await sleep(300)
      assert.ok(clientSide.isPaused(), 'the proxy stays paused while the upstream is not reading')
      assert.ok(maxUpstreamQueue < SIZE + (2 << 20), `the proxy queued ${maxUpstreamQueue} bytes for a slow upstream`)
      assert.ok(ws.bufferedAmount > 0, 'the rest must wait in the client, not in the proxy')

      let got = 0
      let firstBad = ''
      upstreamSide!.on('data', (chunk: Buffer) => {
        let off = 0
        while (off < chunk.length && !firstBad) {
          const i = Math.floor(got / SIZE)
          const at = got % SIZE
          const n = Math.min(SIZE - at, chunk.length - off)
          if (!chunk.subarray(off, off + n).equals(messages[i].subarray(at, at + n))) firstBad = `mismatch in message ${i} at ${at}`
          got += n
          off += n
        }
      })
      upstreamSide!.resume()
      await eventually(() => got >= SIZE * COUNT || !!firstBad, 'every byte to reach the upstream', 20000)
      assert.equal(firstBad, '')
      assert.equal(got, SIZE * COUNT)
      assert.ok(!clientSide.isPaused(), 'the proxy reads from the WebSocket again once the upstream drains')
      assert.equal(ws.bufferedAmount, 0)
      assert.ok(maxUpstreamQueue < SIZE + (2 << 20), `the proxy queued up to ${maxUpstreamQueue} bytes`)
    } finally {
      clearInterval(sampler)
      capture.restore()
      ws?.terminate()
      await p.close()
      await slow.close()
    }
  })

  test('the upstream going away while the client is held back still closes the WebSocket at once', async () => {
    let upstreamSide: net.Socket | undefined
    const slow = await throwaway(
      (s) => {
        s.pause()
        upstreamSide = s
      },
      { login: true }
    )
    const p = await startLocalProxy({ upstream: slow.address, authOffload: false })
    let ws: WebSocket | undefined
    try {
      ws = await openWs(p.url('/v2'))
      const answer = new Promise((resolve) => ws!.once('message', resolve))
      ws.send(startup('trust_user', 'edgepg-slow'))
      await answer
      const chunk = Buffer.alloc(512 << 10, 7)
      for (let i = 0; i < 32; i++) ws.send(chunk) // 16 MiB
      await eventually(() => (p.upgrades[0].socket as net.Socket).isPaused(), 'the proxy to stop reading from the client')
      const done = closed(ws)
      upstreamSide!.destroy()
      // Not ws's 30 s close timeout: the proxy must still read the client's close reply.
      const { code, reason } = await within(3000, 'the client to see the session end', done)
      assert.ok(code === 1011 || code === 1000, `close code ${code} (${reason})`)
      await within(3000, 'the session log', eventually(() => p.logs.length === 1, 'the session log'))
      assert.match(p.logs[0].outcome, /upstream/)
    } finally {
      ws?.terminate()
      await p.close()
      await slow.close()
    }
  })
})

/** Runs `check` on the upstream sockets a proxy opened for one session's query (the session still open). */
async function withUpstreamSockets(check: (sockets: net.Socket[], end: () => Promise<void>) => Promise<void>) {
  const capture = captureUpstreams(PG.port)
  const p = await startLocalProxy()
  try {
    const client = edgeClient(p.url('/v2'))
    await client.connect()
    await client.query('SELECT 1')
    await capture.socket()
    await check(capture.calls.map((c) => c.socket), () => client.end())
  } finally {
    capture.restore()
    await p.close()
  }
}

test('the upstream socket has TCP_NODELAY on', () =>
  withUpstreamSockets(async (sockets, end) => {
    const live = sockets.filter((s) => s.remotePort === PG.port && !s.destroyed)
    assert.equal(live.length, 1, 'one upstream connection serves the client')
    // Node keeps the socket's Nagle setting under an internal symbol, whether it came from the
    // `noDelay` connect option or from setNoDelay(); it is what it applies to the handle.
    for (const socket of sockets) {
      const key = Object.getOwnPropertySymbols(socket).find((s) => s.description === 'kSetNoDelay')
      assert.ok(key, 'this Node keeps no kSetNoDelay on sockets; update this test')
      assert.equal((socket as any)[key], true)
    }
    await end()
  }))

test('the upstream socket has TCP keepalive on, as the kernel reports it: a pooled backend idle across a WAN stays open, or is noticed gone', () =>
  withUpstreamSockets(async (sockets, end) => {
    await end() // (its backend idle in the pool now)
    const ports = sockets.map((s) => s.localPort).filter((port): port is number => port !== undefined)
    assert.ok(ports.length > 0)
    // /proc/net/tcp: "sl local rem st tx:rx tr:when …": tr 2 is the keepalive timer, armed on an idle socket with SO_KEEPALIVE.
    const hex = (port: number) => port.toString(16).toUpperCase().padStart(4, '0')
    await eventually(() => {
      const rows = readFileSync('/proc/net/tcp', 'utf8').split('\n').map((l) => l.trim().split(/\s+/))
      const ours = rows.filter((r) => ports.some((port) => r[1]?.endsWith(`:${hex(port)}`) && r[2]?.endsWith(`:${hex(PG.port)}`)) && r[3] === '01')
      return ours.length > 0 && ours.every((r) => r[5].startsWith('02:'))
    }, 'the kernel to report the keepalive timer on each established upstream socket', 3000)
  }))

describe('session log', () => {
  test('one entry per session with peer, upstream, duration, exact byte counts and outcome', async () => {
    // A plain relay, so the bytes each way are exactly what the raw client sent and received.
    await withProxy({ authOffload: false }, async (p) => {
      // Session 1: the client sends Terminate and Postgres hangs up: still the client's doing.
      const t0 = Date.now()
      const a = await rawSession(p.url('/v2'), 'edgepg-log-a')
      a.send(startup('trust_user', 'edgepg-log-a'))
      await a.readyCount(1)
      a.send(queryMessage('SELECT 1'))
      await a.readyCount(2)
      const aClosed = closed(a.ws)
      a.send(TERMINATE)
      assert.equal((await aClosed).code, 1000)
      await eventually(() => p.logs.length === 1, 'the first session log entry')
      const elapsed = Date.now() - t0

      // Session 2: the client ends it.
      const b = await rawSession(p.url(`/v1?address=${UPSTREAM}`), 'edgepg-log-b')
      b.send(startup('trust_user', 'edgepg-log-b'))
      await b.readyCount(1)
      await closeWs(b.ws)
      await eventually(() => p.logs.length === 2, 'the second session log entry')
      await sleep(100)
      assert.equal(p.logs.length, 2, 'exactly one entry per session')

      const [la, lb] = p.logs
      for (const entry of [la, lb]) {
        assert.deepEqual(Object.keys(entry).sort(), ['authFailed', 'bytesIn', 'bytesOut', 'database', 'durationMs', 'kind', 'outcome', 'peer', 'upstream', 'user'])
        assert.deepEqual([entry.user, entry.database], ['trust_user', PG.database], 'the startup in band names who and where')
        assert.match(entry.peer, /127\.0\.0\.1/)
        assert.equal(entry.upstream, UPSTREAM)
        assert.ok(Number.isFinite(entry.durationMs) && entry.durationMs >= 0, `durationMs ${entry.durationMs}`)
      }
      assert.ok(la.durationMs <= elapsed, `${la.durationMs} ms logged, ${elapsed} ms elapsed`)
      assert.equal(la.bytesIn, a.sent)
      assert.equal(la.bytesOut, a.received)
      assert.equal(lb.bytesIn, b.sent)
      assert.equal(lb.bytesOut, b.received)
      assert.equal(la.outcome, 'closed by client')
      assert.match(lb.outcome, /client/)
    })
  })

  test('never contains the password, whatever the auth method', async () => {
    await withProxy({}, async (p) => {
      const roles = ['password_user', 'md5_user', 'scram_user'] as const // password_user sends it in clear text
      for (const role of roles) {
        const client = new Client({ ...pgConfig(role), webSocketConstructor: WebSocket as any, wsProxy: () => p.url('/v2') })
        await client.connect()
        await client.query('SELECT $1::text AS secret', [PASSWORD])
        await client.end()
      }
      // At least one per client (edgepg may first try a WebSocket subprotocol this proxy declines).
      await eventually(() => p.logs.length >= roles.length, 'one log entry per session')
      const text = JSON.stringify(p.logs)
      assert.ok(!text.includes(PASSWORD), text)
      assert.ok(p.logs.filter((l) => l.bytesIn > 0 && l.bytesOut > 0).length >= roles.length, text)
    })
  })
})

test('upstream unreachable: the WebSocket closes with 1011 and a reason naming the upstream', async () => {
  const port = await freePort() // nothing listens here
  // The proxy connects once the login is in: a startup and its password, as Neon's driver sends them.
  const login = Buffer.concat([startup('scram_user', 'edgepg-unreachable'), passwordMessage(PASSWORD)])
  await withProxy({ upstream: `127.0.0.1:${port}` }, async (p) => {
    const ws = await openWs(p.url('/v2'))
    ws.send(login)
    const { code, reason } = await closed(ws)
    assert.equal(code, 1011)
    assert.match(reason, new RegExp(`127\\.0\\.0\\.1:${port}`))
    await eventually(() => p.logs.length === 1, 'the session log')
    assert.match(p.logs[0].outcome, new RegExp(`127\\.0\\.0\\.1:${port} unreachable`))

    // Also when the client already sent more than the socket buffers before the connect failed.
    const eager = new WebSocket(p.url('/v2'))
    eager.once('open', () => {
      eager.send(login)
      for (let i = 0; i < 64; i++) eager.send(Buffer.alloc(32 << 10))
    })
    const second = await within(3000, 'the close after an eager client', new Promise<{ code: number; reason: string }>((resolve, reject) => {
      eager.once('close', (code, reason) => resolve({ code, reason: reason.toString() }))
      eager.once('error', reject)
    }))
    assert.equal(second.code, 1011)
    assert.match(second.reason, new RegExp(`127\\.0\\.0\\.1:${port}`))
  })
})

describe('CLI', () => {
  // The CLI as the package ships it (dist/cli.mjs): proxy/cli.ts bundled the way
  // esbuild.config.mjs does, into node_modules/.cache (not dist/, which others use) so that `ws`
  // still resolves, and run through its shebang. Much quicker to start than tsx.
  let buildDir = ''
  let BIN: string[] = []
  before(async () => {
    await mkdir(join(ROOT, 'node_modules/.cache'), { recursive: true })
    buildDir = await mkdtemp(join(ROOT, 'node_modules/.cache/edgepg-proxy-test-'))
    const esbuild = await import('esbuild')
    await esbuild.build({ entryPoints: { cli: join(ROOT, 'proxy/cli.ts') }, outdir: buildDir, outExtension: { '.js': '.mjs' }, bundle: true, platform: 'node', format: 'esm', target: 'node20', packages: 'external', logLevel: 'silent' })
    BIN = [join(buildDir, 'cli.mjs')]
    await chmod(BIN[0], 0o755) // as npm does for a package's bin
  })
  after(() => rm(buildDir, { recursive: true, force: true }))

  test('package.json maps edgepg-proxy to the built CLI, which has a node shebang', async () => {
    const pkg = JSON.parse(await readFile(join(ROOT, 'package.json'), 'utf8'))
    assert.equal(pkg.bin['edgepg-proxy'], 'dist/cli.mjs')
    assert.match(await readFile(join(ROOT, 'esbuild.config.mjs'), 'utf8'), /cli: 'proxy\/cli\.ts'/)
    assert.match(await readFile(join(ROOT, 'proxy/cli.ts'), 'utf8'), /^#!\/usr\/bin\/env node\n/)
    assert.match(await readFile(BIN[0], 'utf8'), /^#!\/usr\/bin\/env node\n/)
  })

  test('--help documents every option and exits 0', async () => {
    const run = runCli(['--help'], { command: ['npx', 'tsx', 'proxy/cli.ts'], group: true })
    const { code } = await run.exit(30000)
    assert.equal(code, 0, run.out.stderr)
    // Each option on a line of its own, in its group, essentials first; the one rule naming their variables said once.
    for (const option of ['--upstream', '--listen', '--allow', '--max-message-bytes', '--help']) {
      assert.ok(run.out.stdout.split('\n').some((l) => new RegExp(`^\\s+(-\\w, )?${option}\\b`).test(l)), `--help documents no ${option} option`)
    }
    assert.match(run.out.stdout, /environment variable EDGEPG_ and its name \(--pool-size:\nEDGEPG_POOL_SIZE;/)
    const headings = run.out.stdout.split('\n').filter((l) => /^[A-Z][\w /()]+:$/.test(l))
    assert.deepEqual(headings, ['Essentials:', 'TLS:', 'Limits:', 'Pool:', 'Tokens (signed JWTs instead of passwords):', 'Replicas:', 'POST /sql:', 'Observability:'])
    assert.match(run.out.stdout, /Essentials:\n {2}--upstream host:port {2,}Postgres to relay to \(required\)\n/)
    assert.match(run.out.stdout, /--max-message-bytes size {2,}.*\n.*\(default 64MiB\)/)
    // Every option set apart from what it does, the longest too.
    const options = run.out.stdout.split('\n').filter((l) => /^ {2}(-\w, )?--/.test(l))
    assert.deepEqual(options.filter((l) => !/^ {2}(-\w, )?--[\w-]+( [\w[\]:.|,-]+)? {2,}\S/.test(l)), [])
    assert.equal(new Set(options.map((l) => /^ {2}\S+(?: \S+)? +/.exec(l)![0].length)).size, 1, 'the texts in one column')
    assert.match(run.out.stdout, /\?address=host:port on \/v1 or \/v2/)
    assert.match(run.out.stdout, /\/v2/)
    const short = runCli(['-h'], { command: BIN })
    assert.equal((await short.exit()).code, 0)
    assert.equal(short.out.stdout, run.out.stdout)
  })

  test('usage errors exit 2 with a message naming the problem', async () => {
    const cases: Array<[string[], Record<string, string>, RegExp]> = [
      [[], {}, /--upstream.*required/],
      [['--upstream', 'db.example:notaport'], {}, /--upstream.*db\.example:notaport/],
      [['--upstream', '127.0.0.1:70000'], {}, /--upstream.*127\.0\.0\.1:70000/],
      [['--upstream', UPSTREAM, '--listen', 'here:there'], {}, /--listen.*here:there/],
      [['--upstream', UPSTREAM, '--listen', '127.0.0.1:99999'], {}, /--listen.*127\.0\.0\.1:99999/],
      [['--upstream', UPSTREAM, '--max-message-bytes', 'lots'], {}, /--max-message-bytes.*lots/],
      [['--upstream', UPSTREAM, '--max-message-bytes=0'], {}, /--max-message-bytes.*"0"/],
      [['--upstream', UPSTREAM, '--max-message-bytes', '1.5'], {}, /--max-message-bytes.*1\.5/],
      [['--upstream', UPSTREAM, '--allow', 'nope:nope'], {}, /--allow.*nope:nope/],
      [['--upstream', UPSTREAM, '--frobnicate'], {}, /frobnicate/],
      [[], { EDGEPG_UPSTREAM: 'bad:addr' }, /EDGEPG_UPSTREAM.*bad:addr/],
      [[], { EDGEPG_UPSTREAM: UPSTREAM, EDGEPG_LISTEN: 'x:y' }, /EDGEPG_LISTEN.*x:y/],
    ]
    const runs = cases.map(([args, env]) => runCli(args, { env, command: BIN }))
    for (const [i, run] of runs.entries()) {
      const [args, env, message] = cases[i]
      const { code } = await run.exit()
      const what = `${JSON.stringify(env)} edgepg-proxy ${args.join(' ')}`
      assert.equal(code, 2, `${what}: ${run.out.stderr}`)
      assert.match(run.out.stderr, message, what)
      assert.match(run.out.stderr, /--help/, what)
      assert.equal(run.out.stdout, '', what)
    }
  })

  test('--upstream/--listen: relays for an edgepg client, logs sessions as JSON lines, SIGTERM exits 0', { timeout: 20000 }, async () => {
    const port = await freePort()
    const run = runCli(['--upstream', UPSTREAM, '--listen', `127.0.0.1:${port}`], { command: BIN })
    try {
      assert.equal(await run.listening(), port)
      assert.deepEqual(await queryVia(`ws://127.0.0.1:${port}/v2`), { port: PG.port, u: 'scram_user', echo: 'via proxy' })
      const sessions = () => run.out.stdout.trim().split('\n').map((l) => JSON.parse(l)).filter((e) => 'outcome' in e)
      // edgepg may first try a WebSocket subprotocol and reconnect without: a second, empty session.
      await eventually(() => sessions().some((e) => e.bytesIn > 0), 'the session log line')
      const session = sessions().find((e) => e.bytesIn > 0)
      assert.equal(session.upstream, UPSTREAM)
      assert.equal(typeof session.time, 'string')
      assert.ok(session.bytesOut > 0 && session.durationMs >= 0 && session.outcome, JSON.stringify(session))
      assert.ok(!run.out.stdout.includes(PASSWORD), 'the password appears in the log')

      // SIGTERM with a session still open: it ends the session and exits 0.
      const open = edgeClient(`ws://127.0.0.1:${port}/v2`)
      open.on('error', () => {})
      await open.connect()
      run.child.kill('SIGTERM')
      assert.deepEqual(await run.exit(), { code: 0, signal: null })
      assert.ok(!run.out.stdout.includes(PASSWORD), 'the password appears in the log')
      await within(5000, 'end() after the proxy went away', open.end()).catch(() => {})
    } finally {
      run.child.kill('SIGKILL')
    }
  })

  test('EDGEPG_UPSTREAM, EDGEPG_LISTEN and EDGEPG_ALLOW configure it from the environment', async () => {
    const port = await freePort()
    const other = await throwaway()
    const run = runCli([], { env: { EDGEPG_UPSTREAM: UPSTREAM, EDGEPG_LISTEN: `127.0.0.1:${port}`, EDGEPG_ALLOW: other.address }, command: BIN })
    try {
      assert.equal(await run.listening(), port)
      assert.equal((await queryVia(`ws://127.0.0.1:${port}/v2`)).port, PG.port)
      const ws = await openWs(`ws://127.0.0.1:${port}/v1?address=${other.address}`)
      ws.send(Buffer.concat([startup('trust_user', 'edgepg-env'), passwordMessage('')]))
      await eventually(() => other.connections === 1, 'the allowed address to be dialled')
      ws.terminate()
      assert.equal(await statusOf(`ws://127.0.0.1:${port}/v1?address=127.0.0.1:${other.port === 65535 ? 65534 : other.port + 1}`), 403)
      run.child.kill('SIGTERM')
      assert.equal((await run.exit()).code, 0)
    } finally {
      run.child.kill('SIGKILL')
      await other.close()
    }
  })

  test('--listen PORT alone listens on 127.0.0.1', async () => {
    const port = await freePort()
    const run = runCli(['--upstream', UPSTREAM, '--listen', String(port)], { command: BIN })
    try {
      assert.equal(await run.listening(), port)
      assert.match(run.out.stdout, new RegExp(`"listening":"127\\.0\\.0\\.1:${port}"`))
      assert.equal((await queryVia(`ws://127.0.0.1:${port}/v2`)).port, PG.port)
      run.child.kill('SIGTERM')
      assert.equal((await run.exit()).code, 0)
    } finally {
      run.child.kill('SIGKILL')
    }
  })
})

describe('@neondatabase/serverless pointed at the proxy', () => {
  let p: LocalProxy
  const saved: Record<string, unknown> = {}
  const keys = ['webSocketConstructor', 'useSecureWebSocket', 'pipelineConnect', 'wsProxy'] as const
  const SQL = `SELECT $1::int + 1 AS n, $2::text AS t, $3::numeric * 2 AS d, ARRAY[$1::int, 2] AS a,
    jsonb_build_object('k', $2::text) AS j, '2024-02-29'::date AS day, NULL::text AS z, current_user AS u`
  const PARAMS = [41, 'héllo ✓', '1.25']
  let expected: { rows: unknown[]; fields: Array<{ name: string; dataTypeID: number }> }

  before(async () => {
    p = await startLocalProxy()
    for (const k of keys) saved[k] = (neonConfig as any)[k]
    neonConfig.webSocketConstructor = WebSocket as any
    neonConfig.useSecureWebSocket = false
    neonConfig.pipelineConnect = false
    const direct = new pg.Client(pgConfig('scram_user'))
    await direct.connect()
    const r = await direct.query(SQL, PARAMS)
    expected = { rows: r.rows, fields: r.fields.map((f) => ({ name: f.name, dataTypeID: f.dataTypeID })) }
    await direct.end()
  })
  after(async () => {
    for (const k of keys) (neonConfig as any)[k] = saved[k]
    await p.close()
  })

  const sameAsTcp = (r: { rows: unknown[]; fields: Array<{ name: string; dataTypeID: number }> }) => {
    assert.deepEqual(r.rows, expected.rows)
    assert.deepEqual(r.fields.map((f) => ({ name: f.name, dataTypeID: f.dataTypeID })), expected.fields)
  }

  test('Client and Pool via wsProxy = (host, port) => "<proxy>/v2"', async () => {
    const seen: string[] = []
    neonConfig.wsProxy = (host: string, port: number | string) => {
      seen.push(`${host}:${port}`)
      return `127.0.0.1:${p.port}/v2`
    }
    const client = new NeonClient(pgConfig('scram_user'))
    await within(10000, 'Neon Client connect', client.connect())
    try {
      sameAsTcp(await client.query(SQL, PARAMS))
    } finally {
      await client.end()
    }
    const pool = new NeonPool({ ...pgConfig('scram_user'), max: 2 })
    try {
      const results = await within(10000, 'Neon Pool queries', Promise.all([pool.query(SQL, PARAMS), pool.query(SQL, PARAMS)]))
      results.forEach(sameAsTcp)
    } finally {
      await pool.end()
    }
    assert.ok(seen.length >= 2 && seen.every((s) => s === UPSTREAM), seen.join())
    assert.ok(p.upgrades.length >= 2 && p.upgrades.every((u) => u.url === '/v2'), p.upgrades.map((u) => u.url).join())
  })

  test('Client and Pool via wsProxy = "<proxy>/v1" (Neon appends ?address=host:port)', async () => {
    const before = p.upgrades.length
    neonConfig.wsProxy = `127.0.0.1:${p.port}/v1`
    const client = new NeonClient(pgConfig('scram_user'))
    await within(10000, 'Neon Client connect', client.connect())
    try {
      sameAsTcp(await client.query(SQL, PARAMS))
    } finally {
      await client.end()
    }
    const pool = new NeonPool(pgConfig('scram_user'))
    try {
      sameAsTcp(await within(10000, 'Neon Pool query', pool.query(SQL, PARAMS)))
    } finally {
      await pool.end()
    }
    const urls = p.upgrades.slice(before).map((u) => u.url)
    assert.ok(urls.length >= 2 && urls.every((u) => u === `/v1?address=${UPSTREAM}`), urls.join())
  })
})

test("a limit's refusal is what its client's GET gets for a while; the refusals kept are bounded (1,000 others later, it is gone)", async () => {
  await withProxy({ maxSessionsPerIp: 1 }, async (p) => {
    const held = await openWs(p.url('/v2'))
    try {
      const refused = await upgrade(p.url('/v2'))
      assert.equal(refused.status, 429)
      const ask = async () => {
        const res = await fetch(`http://127.0.0.1:${p.port}/v2`)
        return `${res.status} ${(await res.text()).trim()}`
      }
      assert.equal(await ask(), `429 ${refused.body.trim()}`)
      // Refusals at 1,000 other URLs (long ones too): the first is no longer kept, and the GET gets what the checks say.
      for (let i = 0; i < 1000; i++) await upgrade(p.url(`/elsewhere-${i}-${'x'.repeat(i % 10 ? 10 : 4000)}`))
      assert.equal(await ask(), '426 edgepg-proxy: connect with a WebSocket to /v1 or /v2')
    } finally {
      held.close()
    }
  })
})
