/**
 * A bare TCP relay (no WebSocket, no protocol awareness), run as a child process by the bench to
 * measure what one extra Node process hop costs by itself:
 *
 *   node --import tsx bench/tcp-relay.ts <upstream host:port>
 *
 * Prints {"listening":"127.0.0.1:PORT"} once ready; exits when its stdin closes (its parent died).
 */
import net from 'node:net'
import { announce } from './child'

const [host, port] = (process.argv[2] ?? '').split(':')
if (!host || !port) {
  process.stderr.write('usage: tcp-relay.ts <upstream host:port>\n')
  process.exit(2)
}
const server = net.createServer({ noDelay: true }, (client) => {
  const upstream = net.connect({ host, port: Number(port), noDelay: true })
  client.pipe(upstream).pipe(client)
  client.on('error', () => upstream.destroy())
  upstream.on('error', () => client.destroy())
  client.on('close', () => upstream.destroy())
  upstream.on('close', () => client.destroy())
})
server.listen(0, '127.0.0.1', () => announce(server))
