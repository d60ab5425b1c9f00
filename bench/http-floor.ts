/**
 * The floor for POST /sql as a server: a bare Node HTTP server, run as a child process by the
 * bench, that reads each request's body and answers with the same JSON body /sql gives (passed as
 * its argument), and nothing else: no Postgres, no parsing.
 *
 *   node --import tsx bench/http-floor.ts '<response JSON>'
 *
 * Prints {"listening":"127.0.0.1:PORT"} once ready; exits when its stdin closes (its parent died).
 */
import http from 'node:http'
import { announce } from './child'

const body = Buffer.from(process.argv[2] ?? '{}')
const server = http.createServer((req, res) => {
  req.on('data', () => {})
  req.on('end', () => {
    res.writeHead(200, { 'content-type': 'application/json', 'content-length': body.length })
    res.end(body)
  })
})
server.keepAliveTimeout = 60_000
server.listen(0, '127.0.0.1', () => announce(server))
