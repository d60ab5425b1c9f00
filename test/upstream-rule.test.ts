/**
 * Which Postgres a client may name (proxy/upstream/allowed.ts): one rule for `/v1?address=`,
 * `/v2?address=` and the connection string of POST /sql. Each spelling is tried on each route with
 * the real driver (Client over WebSocket, httpSql over fetch), through a proxy whose --allow entry
 * is a TCP forwarder to the test Postgres: a backend that came through it sees one of its ports as its client's.
 */
import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import http from 'node:http'
import net from 'node:net'
import { WebSocket } from 'ws'
import { Client, httpSql } from '../src/index'
import { pgConfig, startProxy, testPostgres } from './support/helpers'

const PG = testPostgres()
const { user, password, database } = pgConfig('scram_user')
/** The name the proxy is reached by in a deployment (docs/proxy.md: db.example.com), sent as the Host header. */
const PUBLIC_NAME = 'db.example.com'

let proxy: Awaited<ReturnType<typeof startProxy>>
let forwarder: net.Server
/** The local ports of the forwarder's connections to Postgres: a backend whose client port is one of them came through it. */
const forwardedPorts = new Set<number>()

before(async () => {
  forwarder = net.createServer((client) => {
    const pg = net.connect(PG.port, PG.host, () => forwardedPorts.add(pg.localPort!))
    client.pipe(pg).pipe(client)
    for (const s of [client, pg]) s.on('error', () => (client.destroy(), pg.destroy()))
  })
  await new Promise<void>((r) => forwarder.listen(0, '127.0.0.1', r))
  proxy = await startProxy({ allow: [`127.0.0.1:${(forwarder.address() as net.AddressInfo).port}`] })
})

after(async () => {
  await proxy?.close()
  forwarder?.close()
})

type Route = '/v1' | '/v2' | '/sql'
type Where = 'upstream' | 'allowed' | 403

/** Runs a query naming `address` on `route`, in a request sent with Host `host`: where it went, or 403. */
async function reach(route: Route, address: string, host?: string): Promise<Where> {
  const rows = route === '/sql' ? await overHttp(address, host) : await overWebSocket(route, address, host)
  if (rows === 403) return 403
  return forwardedPorts.has(Number(rows[0].port)) ? 'allowed' : 'upstream'
}

/** Where the statement ran: the client port its backend sees. */
const WHERE = 'SELECT inet_client_port() AS port'

/** A WebSocket constructor whose upgrades carry Host `host` (ws's own default: the URL's). */
function sentTo(host: string | undefined) {
  return class extends WebSocket {
    constructor(url: string, protocols?: string | string[]) {
      super(url, protocols, host ? { headers: { host } } : {})
    }
  }
}

async function overWebSocket(route: '/v1' | '/v2', address: string, host?: string): Promise<Array<{ port: number }> | 403> {
  const client = new Client({ user, password, database, webSocketConstructor: sentTo(host) as any, wsProxy: () => `ws://127.0.0.1:${proxy.port}${route}?address=${encodeURIComponent(address)}` })
  client.on('error', () => {})
  try {
    await client.connect()
  } catch (err) {
    assert.match(String((err as Error).message), /403/, `refused as 403: ${(err as Error).message}`)
    return 403
  }
  try {
    return (await client.query(WHERE)).rows
  } finally {
    await client.end()
  }
}

async function overHttp(address: string, host?: string): Promise<Array<{ port: number }> | 403> {
  const sql = httpSql(`postgresql://${user}:${encodeURIComponent(String(password))}@${address}/${database}`, { fetchEndpoint: `http://127.0.0.1:${proxy.port}/sql`, fetch: host ? fetchWithHost(host) : undefined })
  try {
    return (await sql.query(WHERE)) as Array<{ port: number }>
  } catch (err) {
    assert.match(String((err as Error).message), /403.*is not an allowed upstream: name the proxy's own host, its upstream/s, `refused as 403, saying what to name: ${(err as Error).message}`)
    return 403
  }
}

/** fetch with a Host header of our choosing (fetch itself never sends one), as a request to a public name arrives. */
function fetchWithHost(host: string): typeof fetch {
  return (async (url: string, init: RequestInit) => {
    const body = String(init.body)
    const { status, text } = await new Promise<{ status: number; text: string }>((resolve, reject) => {
      const req = http.request(url, { method: init.method, headers: { ...Object.fromEntries((new Headers(init.headers) as unknown as Iterable<[string, string]>)), host } }, (res) => {
        let text = ''
        res.setEncoding('utf8').on('data', (d) => (text += d)).on('end', () => resolve({ status: res.statusCode!, text }))
      })
      req.on('error', reject)
      req.end(body)
    })
    return new Response(text, { status, headers: { 'content-type': 'application/json' } })
  }) as typeof fetch
}

const forwarderAddress = () => `127.0.0.1:${(forwarder.address() as net.AddressInfo).port}`
const otherPort = () => (PG.port === 65535 ? 65534 : PG.port + 1)

/** [what, address, Host header, where it goes]: the same on every route. */
const SPELLINGS: Array<[string, () => string, string | undefined, Where]> = [
  ['the upstream, exactly', () => `${PG.host}:${PG.port}`, undefined, 'upstream'],
  ['localhost for an upstream on this machine', () => `localhost:${PG.port}`, undefined, 'upstream'],
  ['LOCALHOST, in capitals', () => `LOCALHOST:${PG.port}`, undefined, 'upstream'],
  ['[::1] for an upstream on this machine', () => `[::1]:${PG.port}`, undefined, 'upstream'],
  ["the proxy's own public name, sent to it", () => `${PUBLIC_NAME}:${PG.port}`, PUBLIC_NAME, 'upstream'],
  ["the proxy's own public name in capitals, sent to it with a port", () => `DB.Example.COM:${PG.port}`, `${PUBLIC_NAME}:443`, 'upstream'],
  ['an --allow entry', forwarderAddress, undefined, 'allowed'],
  ['a public name the request was not sent to', () => `${PUBLIC_NAME}:${PG.port}`, undefined, 403],
  ["the proxy's own public name at another port", () => `${PUBLIC_NAME}:${otherPort()}`, PUBLIC_NAME, 403],
  ["another port of the upstream's host", () => `${PG.host}:${otherPort()}`, undefined, 403],
  ['localhost at another port', () => `localhost:${otherPort()}`, undefined, 403],
  ['another machine', () => `10.9.8.7:${PG.port}`, undefined, 403],
  ['another machine, named in Host too: still only the upstream', () => `10.9.8.7:${PG.port}`, '10.9.8.7', 'upstream'],
]

for (const route of ['/v1', '/v2', '/sql'] as const) {
  test(`${route}: each spelling of an upstream goes where the one rule says (the upstream, an --allow entry, or 403 saying what to name)`, async () => {
    for (const [what, address, host, where] of SPELLINGS) {
      assert.equal(await reach(route, address(), host), where, `${route}, ${what}: ${address()}${host ? ` (Host: ${host})` : ''}`)
    }
  })
}

test('/v2 naming no address goes to the upstream, whatever Host it was sent with', async () => {
  for (const host of [undefined, PUBLIC_NAME, '10.9.8.7']) {
    const client = new Client({ user, password, database, webSocketConstructor: sentTo(host) as any, wsProxy: () => `ws://127.0.0.1:${proxy.port}/v2` })
    await client.connect()
    const [{ port }] = (await client.query(WHERE)).rows
    await client.end()
    assert.ok(!forwardedPorts.has(port), `Host ${host}: the upstream, not the allowed forwarder`)
  }
})
