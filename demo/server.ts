/**
 * The SQL console's own HTTP server: the page (demo/*.html|js|css), the built driver (dist/*.mjs),
 * the connection details (/config.json), and the network to edgepg-proxy with an optional delay:
 * `/net/<rtt>/v2` (WebSocket) and `/net/<rtt>/sql` (HTTP), RTT in ms; and for the signed-in users
 * page (users.html), /public.json and the demo's sign-in, /signin?user=…, which answers a token. Serving all of it from one
 * origin keeps fetch free of CORS preflights, which would add a round trip to every HTTP query.
 */
import http from 'node:http'
import { readFile } from 'node:fs/promises'
import type { AddressInfo } from 'node:net'
import type { Duplex } from 'node:stream'
import { dirname, join, resolve } from 'node:path'
import { fileURLToPath } from 'node:url'
import { closeRelays, relayRequest, relayUpgrade, type Target } from './relay'
import { USERS, type DemoUser } from './auth'

const DEMO_DIR = dirname(fileURLToPath(import.meta.url))
const DIST_DIR = resolve(DEMO_DIR, '../dist')
const TYPES: Record<string, string> = { '.html': 'text/html; charset=utf-8', '.js': 'text/javascript; charset=utf-8', '.mjs': 'text/javascript; charset=utf-8', '.css': 'text/css; charset=utf-8' }
/** The delays the page offers; the relay accepts any RTT up to MAX_RTT_MS. */
export const RTTS = [0, 50, 100, 200]
const MAX_RTT_MS = 2000
const NET_ROUTE = /^\/net\/(\d{1,4})\/(v2|sql)$/

export interface ConsoleInfo {
  /** What the page connects with: the demo role on the demo's Postgres. */
  connection: { host: string; port: number; user: string; password: string; database: string }
  proxy: Target
  /** The demo's sign-in: a token for one of USERS (demo/auth.ts). */
  signIn: (user: DemoUser) => Promise<string>
}

export function createConsoleServer(info: ConsoleInfo) {
  const sockets = new Set<Duplex>()
  const net = (url: string) => {
    const m = NET_ROUTE.exec(new URL(url, 'http://console').pathname)
    if (!m || Number(m[1]) > MAX_RTT_MS) return undefined
    return { oneWayMs: Number(m[1]) / 2, path: '/' + m[2] }
  }

  const server = http.createServer(async (req, res) => {
    const path = new URL(req.url ?? '/', 'http://console').pathname
    const route = net(req.url ?? '/')
    if (route) return void relayRequest(req, res, info.proxy, route.path, route.oneWayMs)
    if (req.method !== 'GET' && req.method !== 'HEAD') return void res.writeHead(405, { allow: 'GET' }).end()
    if (path === '/config.json') return send(res, 200, '.json', JSON.stringify({ connection: info.connection, rtts: RTTS }))
    // users.html's: where the database is, and who may sign in; no password.
    const { host, port, database } = info.connection
    if (path === '/public.json') return send(res, 200, '.json', JSON.stringify({ host, port, database, users: USERS }))
    if (path === '/signin') {
      const user = new URL(req.url ?? '/', 'http://console').searchParams.get('user')
      if (!user || !Object.hasOwn(USERS, user)) return send(res, 404, '.txt', `no such user: ${user}\n`)
      return send(res, 200, '.json', JSON.stringify({ token: await info.signIn(user as DemoUser) }))
    }
    // Only the page's own files and the driver bundle; names are checked, never joined blindly.
    const file =
      path === '/' ? join(DEMO_DIR, 'index.html')
      : /^\/[\w-]+\.(html|js|css)$/.test(path) ? join(DEMO_DIR, path)
      : /^\/dist\/(chunks\/)?[\w.-]+\.mjs$/.test(path) ? join(DIST_DIR, path.slice('/dist/'.length))
      : undefined
    const body = file && (await readFile(file).catch(() => undefined))
    if (!body) return send(res, 404, '.txt', `not found: ${path}${path.startsWith('/dist/') ? ' (run npm run build)' : ''}\n`)
    send(res, 200, file.slice(file.lastIndexOf('.')), body)
  })
  server.on('upgrade', (req, socket, head) => {
    const route = net(req.url ?? '/')
    if (!route || route.path !== '/v2') return void socket.end('HTTP/1.1 404 Not Found\r\nConnection: close\r\n\r\n')
    relayUpgrade(req, socket, head, info.proxy, route.path, route.oneWayMs, sockets)
  })

  return {
    server,
    listen: (port: number, host = '127.0.0.1') =>
      new Promise<AddressInfo>((resolve, reject) => {
        server.once('error', reject)
        server.listen(port, host, () => resolve(server.address() as AddressInfo))
      }),
    close: () =>
      new Promise<void>((resolve) => {
        for (const s of sockets) s.destroy()
        closeRelays()
        server.close(() => resolve())
        server.closeAllConnections()
      }),
  }
}

function send(res: http.ServerResponse, status: number, ext: string, body: string | Buffer) {
  res.writeHead(status, { 'content-type': TYPES[ext] ?? (ext === '.json' ? 'application/json' : 'text/plain; charset=utf-8'), 'cache-control': 'no-store' })
  res.end(body)
}
