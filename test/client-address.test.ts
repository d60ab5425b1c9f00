/**
 * The client's address behind a load balancer (`--trust-proxy`): the PROXY protocol (v1 and v2,
 * read at every split), X-Forwarded-For, and the real proxy taking per-IP limits, logs and the
 * password rule from the declared address, from trusted peers only.
 */
import { test } from 'node:test'
import assert from 'node:assert/strict'
import net from 'node:net'
import tls from 'node:tls'
import { WebSocket } from 'ws'
import { readProxyHeader } from '../proxy/listen/proxy-protocol'
import { ClientAddresses, limitKey } from '../proxy/listen/client-address'
import { Client } from '../src/index'
import { edgeConfig, eventually, startProxy, testPostgres, within } from './support/helpers'
import { generateCerts } from './support/certs'
import { PASSWORD } from './support/stack'

const HTTP = Buffer.from('GET /v2 HTTP/1.1\r\nHost: x\r\n\r\n')

function v2(address: number[] | null, command = 1): Buffer {
  const head = Buffer.from([0x0d, 0x0a, 0x0d, 0x0a, 0x00, 0x0d, 0x0a, 0x51, 0x55, 0x49, 0x54, 0x0a, 0x20 | command])
  if (!address) return Buffer.concat([head, Buffer.from([0x00, 0, 0])])
  const six = address.length === 16
  const body = Buffer.concat([Buffer.from(address), Buffer.from(six ? Array(16).fill(0) : [127, 0, 0, 1]), Buffer.from([0x15, 0xb3, 0x00, 0x50]), Buffer.from([0x04, 0, 1, 7])])
  const len = Buffer.alloc(2)
  len.writeUInt16BE(body.length)
  return Buffer.concat([head, Buffer.from([six ? 0x21 : 0x11]), len, body])
}

test('PROXY headers, v1 and v2, split at every byte: more until whole, then the source address and the length to skip', () => {
  const cases: Array<[Buffer, string | undefined]> = [
    [Buffer.from('PROXY TCP4 203.0.113.7 127.0.0.1 5555 80\r\n'), '203.0.113.7'],
    [Buffer.from('PROXY TCP6 2001:db8::7 ::1 5555 80\r\n'), '2001:db8::7'],
    [Buffer.from('PROXY UNKNOWN\r\n'), undefined],
    [v2([203, 0, 113, 9]), '203.0.113.9'],
    [v2([0x20, 0x01, 0x0d, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 9]), '2001:db8:0:0:0:0:0:9'],
    [v2(null, 0), undefined], // LOCAL: a health check of the balancer's own
  ]
  for (const [header, address] of cases) {
    const bytes = Buffer.concat([header, HTTP])
    for (let cut = 1; cut < header.length; cut++) assert.deepEqual(readProxyHeader(bytes.subarray(0, cut)).kind, 'more', `${header.toString('latin1').slice(0, 20)} cut at ${cut}`)
    for (let cut = header.length; cut <= bytes.length; cut++) assert.deepEqual(readProxyHeader(bytes.subarray(0, cut)), { kind: 'header', length: header.length, ...(address && { address }) })
  }
  assert.deepEqual(readProxyHeader(HTTP), { kind: 'none' })
  assert.deepEqual(readProxyHeader(Buffer.from('POST /sql HTTP/1.1\r\n')), { kind: 'none' })
  assert.throws(() => readProxyHeader(Buffer.from('PROXY SCTP 1.2.3.4 5.6.7.8 1 2\r\n')), /malformed PROXY v1/)
  assert.throws(() => readProxyHeader(Buffer.from(`PROXY TCP4 ${'9'.repeat(120)}`)), /without its CRLF/)
  const badVersion = v2([1, 2, 3, 4])
  badVersion[12] = 0x11
  assert.throws(() => readProxyHeader(badVersion), /version 1/)
})

test('X-Forwarded-For counts only from trusted peers, and only up to the nearest untrusted hop', () => {
  const addresses = new ClientAddresses(['127.0.0.1', '10.0.0.0/8'])
  const socket = (remoteAddress: string) => ({ remoteAddress, remotePort: 1 }) as net.Socket
  const xff = (v: string) => ({ 'x-forwarded-for': v })
  assert.equal(addresses.of(socket('198.51.100.1'), xff('203.0.113.7')), '198.51.100.1', 'an untrusted peer says what it likes')
  assert.equal(addresses.of(socket('::ffff:127.0.0.1'), xff('203.0.113.7')), '203.0.113.7')
  assert.equal(addresses.of(socket('127.0.0.1'), xff('6.6.6.6, 203.0.113.7, 10.1.2.3')), '203.0.113.7', 'a client cannot prepend its own claim')
  assert.equal(addresses.of(socket('127.0.0.1'), xff('10.0.0.1, 10.0.0.2')), '10.0.0.1')
  assert.equal(addresses.of(socket('127.0.0.1'), xff('not an address')), 'not an address', 'what the balancer wrote, for all that')
  assert.equal(addresses.of(socket('127.0.0.1')), '127.0.0.1')
  assert.throws(() => new ClientAddresses(['10.0.0.0/8', 'example.com']), /not an address or CIDR range/)
})

/** A `ws` WebSocket whose TCP connection first sends `header` (as HAProxy's send-proxy does). */
const ProxiedWebSocket = (header: () => Buffer) =>
  class extends WebSocket {
    constructor(url: string, protocols?: string | string[]) {
      super(url, protocols, {
        createConnection: (options: net.NetConnectOpts) => {
          const socket = net.connect(options)
          socket.write(header())
          return socket
        },
      } as any)
    }
  }

test('an X-Forwarded-For hop that is not a bare address ends the walk: that hop is the client (its port dropped), whatever the client claimed before it', () => {
  const addresses = new ClientAddresses(['127.0.0.1'])
  const of = (v: string) => addresses.of({ remoteAddress: '127.0.0.1', remotePort: 1 } as net.Socket, { 'x-forwarded-for': v })
  assert.equal(of('127.0.0.9, 203.0.113.5:4444'), '203.0.113.5')
  assert.equal(of('127.0.0.9, [2001:db8::5]:4444'), '2001:db8::5')
  assert.equal(of('127.0.0.9, [::ffff:203.0.113.5]:4444'), '203.0.113.5')
  assert.equal(of('127.0.0.9, unknown'), 'unknown')
  assert.equal(of('127.0.0.9, 127.0.0.1:80x'), '127.0.0.1:80x')
  assert.equal(of('127.0.0.9, 203.0.113.5:4444, 127.0.0.1'), '203.0.113.5', 'behind a second trusted hop')
})

/** Opens a WebSocket to `p` with `headers`: the socket, or the refusal's status and text. */
const openWith = (p: { url: string }, headers: Record<string, string>) =>
  new Promise<WebSocket | string>((resolve) => {
    const ws = new WebSocket(p.url, { headers })
    ws.once('open', () => resolve(ws))
    ws.once('unexpected-response', (_req, res) => {
      let body = ''
      res.on('data', (d: Buffer) => (body += d)).on('end', () => resolve(`${res.statusCode} ${body.trim()}`))
    })
  })

test('behind an HTTP balancer writing hops with their port: a claimed 127.0.0.9 gets no loopback password rule, and varied claims no more sessions than the per-IP limit', async () => {
  const p = await startProxy({ trustProxy: ['127.0.0.1/32'], maxSessionsPerIp: 2 })
  const opened: WebSocket[] = []
  try {
    const forwarded = (claim: string, port: number) => ({ 'x-forwarded-for': `${claim}, 203.0.113.5:${port}` })
    const Forwarding = class extends WebSocket {
      constructor(url: string, protocols?: string | string[]) {
        super(url, protocols, { headers: forwarded('127.0.0.9', 4444) })
      }
    }
    const c = new Client(edgeConfig(p.port, 'scram_user', { webSocketConstructor: Forwarding as any }))
    c.on('error', () => {})
    await assert.rejects(c.connect(), /refuses passwords over unencrypted ws:\/\/ from a non-loopback client/)
    const answers = []
    for (let i = 0; i < 5; i++) {
      const answer = await openWith(p, forwarded(`198.51.100.${i}`, 5000 + i))
      if (answer instanceof WebSocket) opened.push(answer)
      answers.push(answer instanceof WebSocket ? 'open' : answer)
    }
    assert.deepEqual(answers, ['open', 'open', ...Array(3).fill('429 too many sessions from 203.0.113.5 (2)')])
  } finally {
    for (const ws of opened) ws.terminate()
    await p.close()
  }
})

test('PROXY v2 from a dual-stack balancer: an IPv4-mapped IPv6 client (::ffff:a.b.c.d) is counted as its IPv4 address, not by the /64 all of them share', async () => {
  const mapped = (last: number) => [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 203, 0, 113, last]
  assert.deepEqual(readProxyHeader(v2(mapped(7))), { kind: 'header', length: v2(mapped(7)).length, address: '203.0.113.7' })
  const p = await startProxy({ trustProxy: ['127.0.0.1/32'], maxSessionsPerIp: 1 })
  const open = (last: number) =>
    new Promise<WebSocket | string>((resolve) => {
      const ws = new (ProxiedWebSocket(() => v2(mapped(last))))(p.url)
      ws.once('open', () => resolve(ws))
      ws.once('unexpected-response', (_req, res) => resolve(String(res.statusCode)))
      ws.once('error', (err) => resolve(err.message))
    })
  const opened: WebSocket[] = []
  try {
    const answers = []
    for (const last of [7, 8, 7]) {
      const answer = await open(last)
      if (answer instanceof WebSocket) opened.push(answer)
      answers.push(answer instanceof WebSocket ? 'open' : answer)
    }
    assert.deepEqual(answers, ['open', 'open', '429'])
  } finally {
    for (const ws of opened) ws.terminate()
    await p.close()
  }
})

test('per-IP limits count an IPv4 address as itself, and an IPv6 address by its /64', () => {
  assert.equal(limitKey('203.0.113.7'), '203.0.113.7')
  assert.equal(limitKey('::ffff:203.0.113.7'), '203.0.113.7')
  for (const address of ['2001:db8::1', '2001:db8:0:0:ffff::2', '2001:0DB8:0000:0000:1:2:3:4', '2001:db8::5.6.7.8', '2001:db8::1%eth0']) {
    assert.equal(limitKey(address), '2001:db8:0:0::/64', address)
  }
  assert.equal(limitKey('2001:db8:0:1::1'), '2001:db8:0:1::/64')
  assert.equal(limitKey('1::2:3:4:5:6.7.8.9'), '1:0:2:3::/64', 'an IPv4 tail is two groups')
  assert.equal(limitKey('::1'), '0:0:0:0::/64')
})

test('an IPv6 client is one client for its whole /64: a second session from the same /64 is refused, one from another /64 is not', async () => {
  const p = await startProxy({ trustProxy: ['127.0.0.1/32'], maxSessionsPerIp: 1 })
  const open = (from: string) =>
    new Promise<WebSocket | string>((resolve) => {
      const ws = new WebSocket(p.url, { headers: { 'x-forwarded-for': from } })
      ws.once('open', () => resolve(ws))
      ws.once('unexpected-response', (_req, res) => {
        let body = ''
        res.on('data', (d: Buffer) => (body += d)).on('end', () => resolve(`${res.statusCode} ${body.trim()}`))
      })
    })
  const opened: WebSocket[] = []
  try {
    const first = await open('2001:db8::1')
    assert.ok(first instanceof WebSocket)
    opened.push(first)
    assert.equal(await open('2001:db8::2'), '429 too many sessions from 2001:db8:0:0::/64 (1)')
    const other = await open('2001:db8:0:1::1')
    assert.ok(other instanceof WebSocket, `another /64: ${other}`)
    opened.push(other)
  } finally {
    for (const ws of opened) ws.terminate()
    await p.close()
  }
})

test("behind a trusted balancer (PROXY protocol): per-IP limits, logs and the password rule are the declared client's", async () => {
  const logs: any[] = []
  // (TLS ends at the balancer, as --allow-insecure-passwords says; without it, below.)
  const p = await startProxy({ trustProxy: ['127.0.0.1/32'], maxSessionsPerIp: 1, allowInsecurePasswords: true, log: (e) => logs.push(e), pool: { mode: 'session' } })
  const strict = await startProxy({ trustProxy: ['127.0.0.1/32'] })
  const from = (proxy: typeof p, address: string) => {
    const line = () => Buffer.from(`PROXY TCP4 ${address} 127.0.0.1 40000 ${proxy.port}\r\n`)
    const c = new Client(edgeConfig(proxy.port, 'scram_user', { webSocketConstructor: ProxiedWebSocket(line) as any }))
    c.on('error', () => {})
    return c
  }
  try {
    const a = from(p, '203.0.113.7')
    await a.connect()
    // The same declared client again: over its limit of one.
    await assert.rejects(from(p, '203.0.113.7').connect(), /429|too many sessions from 203\.0\.113\.7/)
    // Another client behind the same balancer has a limit of its own.
    const b = from(p, '203.0.113.8')
    await b.connect()
    await Promise.all([a.end(), b.end()])
    await eventually(() => logs.some((l) => l.peer === '203.0.113.7') && logs.some((l) => l.peer === '203.0.113.8'), 'sessions logged with the declared addresses')
    assert.ok(!logs.some((l) => l.peer === '127.0.0.1'), 'no session logged as the balancer')
    // Over plain ws:// a password from a remote client is refused, though the balancer is on loopback.
    await assert.rejects(from(strict, '203.0.113.9').connect(), /refuses passwords over unencrypted ws:\/\/ from a non-loopback client/)
    const local = from(strict, '127.0.0.1')
    await local.connect()
    await local.end()
  } finally {
    await p.close()
    await strict.close()
  }
})

/** An edgepg Client whose connection a balancer on loopback declares (PROXY v1) to be from `address`. */
function declaredClient(proxyPort: number, address: string) {
  const line = () => Buffer.from(`PROXY TCP4 ${address} 127.0.0.1 40000 ${proxyPort}\r\n`)
  const c = new Client(edgeConfig(proxyPort, 'scram_user', { webSocketConstructor: ProxiedWebSocket(line) as any }))
  c.on('error', () => {})
  return c
}

test('the password rule holds once the pool key is warm: a remote client over ws:// is refused after a local one warmed it (both pool modes)', async () => {
  for (const mode of ['transaction', 'session'] as const) {
    const p = await startProxy({ trustProxy: ['127.0.0.1/32'], pool: { mode } })
    const idle = async () => (await p.metrics.registry.getSingleMetric('edgepg_proxy_pool_idle_backends')!.get()).values[0].value
    try {
      const local = declaredClient(p.port, '127.0.0.1')
      await local.connect()
      await local.query('SELECT 1')
      await local.end()
      await eventually(async () => (await idle()) > 0, `${mode}: a warm backend for the key`)
      await assert.rejects(declaredClient(p.port, '203.0.113.9').connect(), /refuses passwords over unencrypted ws:\/\/ from a non-loopback client/, mode)
    } finally {
      await p.close()
    }
  }
})

test('a PROXY header from a peer that is not trusted is not taken: the request is refused, and limits stay its own', async () => {
  const p = await startProxy({ trustProxy: ['10.0.0.0/8'] })
  try {
    const answer = await new Promise<string>((resolve) => {
      const s = net.connect(p.port, '127.0.0.1', () => s.write(Buffer.concat([Buffer.from('PROXY TCP4 203.0.113.7 127.0.0.1 1 2\r\n'), HTTP])))
      let got = ''
      s.on('data', (d) => (got += d))
      s.on('close', () => resolve(got))
      s.on('error', () => resolve(got))
    })
    assert.match(answer, /^HTTP\/1\.1 400/)
  } finally {
    await p.close()
  }
})

test('/sql behind a trusted HTTP balancer: the client is the X-Forwarded-For address; from anyone else, the peer', async () => {
  const db = testPostgres()
  for (const trusted of [true, false]) {
    const logs: any[] = []
    const p = await startProxy({ trustProxy: trusted ? ['127.0.0.1'] : undefined, allowInsecurePasswords: true, sqlLog: (e) => logs.push(e) })
    try {
      const res = await fetch(`http://127.0.0.1:${p.port}/sql`, {
        method: 'POST',
        headers: { 'x-forwarded-for': '203.0.113.7', 'neon-connection-string': `postgres://scram_user:${PASSWORD}@${db.host}:${db.port}/${db.database}`, 'content-type': 'application/json' },
        body: JSON.stringify({ query: 'SELECT 1', params: [] }),
      })
      assert.equal(res.status, 200, await res.text())
      await eventually(() => logs.length > 0, 'the request logged')
      assert.equal(logs[0].peer, trusted ? '203.0.113.7' : '127.0.0.1')
    } finally {
      await p.close()
    }
  }
})

test('with TLS behind a trusted balancer: the ClientHello reaches TLS whether it comes in the PROXY header\'s packet, after it, or with no header at all', async () => {
  const certs = await generateCerts()
  const p = await startProxy({ trustProxy: ['127.0.0.1/32'], tls: { cert: certs.server.cert, key: certs.server.key } })
  try {
    const signature = Buffer.from([0x0d, 0x0a, 0x0d, 0x0a, 0x00, 0x0d, 0x0a, 0x51, 0x55, 0x49, 0x54, 0x0a])
    const local = Buffer.concat([signature, Buffer.from([0x20, 0x00, 0, 0])]) // a health check's: LOCAL
    const proxied = Buffer.concat([signature, Buffer.from([0x21, 0x11, 0, 12, 127, 0, 0, 9, 127, 0, 0, 1, 0x30, 0x39, 0x01, 0xbb])])
    // What a balancer's check asks over TLS (its PROXY header, if any, in the ClientHello's packet or apart).
    const healthz = async (header: Buffer | undefined, apart: boolean) => {
      const socket = net.connect(p.port, '127.0.0.1')
      await new Promise((resolve) => socket.once('connect', resolve))
      if (header && apart) await new Promise((resolve) => socket.write(header, resolve))
      else if (header) socket.cork(), socket.write(header), process.nextTick(() => socket.uncork())
      const secure = tls.connect({ socket, ca: certs.ca.cert, servername: 'localhost' })
      return within(5000, `/healthz over TLS (${header ? (apart ? 'header apart' : 'header with the ClientHello') : 'no header'})`, new Promise<string>((resolve, reject) => {
        let text = ''
        secure.once('secureConnect', () => secure.write('GET /healthz HTTP/1.0\r\n\r\n'))
        secure.on('data', (d) => (text += d)).once('end', () => resolve(text.split('\r\n')[0])).once('error', reject)
      }))
    }
    for (const header of [local, proxied, undefined]) for (const apart of [false, true]) assert.equal(await healthz(header, apart), 'HTTP/1.1 200 OK')
  } finally {
    await p.close()
    await certs.cleanup()
  }
})
